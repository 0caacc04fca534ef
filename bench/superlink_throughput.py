"""Messages per second through one Flower SuperLink, with as many SuperNodes as this machine holds.

A real ``flower-superlink`` and N ``flower-supernode`` processes on 127.0.0.1 (Fedge's launch
sequence, ``fedge.launcher.sequence``) run ``bench/flower_echo``: each round the ServerApp sends one
small query to every node and waits for every reply; the ClientApp echoes it. No training, no
Fedge code in the app: what is measured is Flower's message path.

Reported: messages per second the federation sustained (2 per node per round: the instruction and
its reply, both through the SuperLink), the SuperLink process's CPU seconds (utime + stime from
/proc) over the measured rounds and so its CPU cost per message, and resident memory of the
SuperLink and of one SuperNode. On this engine every message starts a fresh ClientApp process on
the SuperNode, so N nodes on 2 cores are bounded by process start-up, not by the SuperLink; its CPU
per message is the figure that extrapolates (docs/capacity.md).

    .venv/bin/python bench/superlink_throughput.py --supernodes 40 --rounds 5

``--idle-seconds S`` measures what connected devices cost a SuperLink when no run is going on,
the load that sizes a SuperLink for many devices: N SuperNodes connect, and once each has settled
(its own CPU still), the SuperLink's CPU seconds over S seconds. An idle SuperNode of flwr 1.42
pulls for messages every 3 s (``start_client_internal``) and sends a heartbeat every 20 s on
average (``flwr.supercore.heartbeat``): 0.38 requests per second, of which the pulls are 87%.
Reported: the SuperLink's share of a core per connected device, hence devices per core; with a
run of 0 SuperNodes in the same call (the SuperLink's own idle load), the marginal figures too.

    .venv/bin/python bench/superlink_throughput.py --supernodes 0 10 40 --idle-seconds 120
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.launcher.app_bundle import stage_directory
from fedge.launcher.environment import flower_environment
from fedge.launcher.processes import ManagedProcess, ProcessGroup
from fedge.launcher.sequence import FlowerLaunch

ECHO_APP = Path(__file__).resolve().parent / "flower_echo"
_TICK = 1 / 100  # /proc/<pid>/stat counts clock ticks (USER_HZ, 100 on Linux)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK  # utime, stime


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


@dataclass
class _Federation:
    run_dir: Path
    flower: FlowerLaunch
    link: ManagedProcess
    nodes: list[ManagedProcess]


@contextmanager
def _federation(supernodes: int, isolation: str) -> Iterator[_Federation]:
    """A SuperLink and ``supernodes`` SuperNodes on 127.0.0.1 in a fresh run directory; every
    process stopped on the way out."""
    run_dir = Path(tempfile.mkdtemp(prefix="superlink-"))
    env = flower_environment(run_dir / "flwr-home")
    group = ProcessGroup(run_dir / "logs", env=env, also_match={"FLWR_HOME": env["FLWR_HOME"]})
    try:
        flower = FlowerLaunch(group, run_dir / "flwr-home", isolation=isolation)
        link = flower.start_superlink(cwd=run_dir)
        nodes = [flower.start_supernode(i, {"partition-id": i, "num-partitions": supernodes}, cwd=run_dir)
                 for i in range(supernodes)]
        yield _Federation(run_dir, flower, link, nodes)
    finally:
        group.stop()


def measure(supernodes: int, rounds: int, payload: int, timeout: float, isolation: str = "warm") -> dict[str, Any]:
    cpu: list[tuple[int, float]] = []  # (rounds done, SuperLink CPU seconds)
    rss = {"superlink": 0.0, "supernode": 0.0}
    started = time.monotonic()
    with _federation(supernodes, isolation) as fed:
        run_dir, flower, link, nodes = fed.run_dir, fed.flower, fed.link, fed.nodes
        flwr_home, out_path = run_dir / "flwr-home", run_dir / "rounds.jsonl"
        run_config = {"num-server-rounds": rounds + 1, "min-nodes": supernodes, "payload-bytes": payload,
                      "out-path": str(out_path)}
        runner = flower.submit(stage_directory(flwr_home / "app", ECHO_APP), run_config, cwd=run_dir)

        def tick() -> bool:
            done = len(_lines(out_path))
            if not cpu or cpu[-1][0] != done:
                cpu.append((done, _cpu_seconds(link.popen.pid)))
            rss["superlink"] = max(rss["superlink"], _rss_mib(link.popen.pid))
            rss["supernode"] = max(rss["supernode"], _rss_mib(nodes[0].popen.pid))
            return False

        flower.follow(runner, started + timeout, tick)
        lines = _lines(out_path)
        if runner.popen.returncode != 0 or len(lines) != rounds + 1:
            raise RuntimeError(f"the echo run failed (exit {runner.popen.returncode}, {len(lines)} rounds); "
                               f"logs in {run_dir / 'logs'}:\n{runner.log_tail(30)}")
    measured = lines[1:]  # round 1 carries every node's first ClientApp start: reported apart
    messages = sum(2 * line["replied"] for line in measured)
    seconds = sum(line["seconds"] for line in measured)
    first = next((c for n, c in cpu if n >= 1), None)
    last = next((c for n, c in reversed(cpu) if n >= rounds + 1), cpu[-1][1] if cpu else None)
    link_cpu = None if first is None or last is None else last - first
    return {
        "supernodes": supernodes, "isolation": flower.isolation, "rounds_measured": len(measured), "payload_bytes": payload,
        "first_round_seconds": lines[0]["seconds"], "messages": messages, "seconds": seconds,
        "messages_per_second": messages / seconds if seconds else None,
        "superlink_cpu_seconds": link_cpu,
        "superlink_cpu_ms_per_message": None if not link_cpu or not messages else 1000 * link_cpu / messages,
        "superlink_peak_rss_mib": rss["superlink"], "supernode_peak_rss_mib": rss["supernode"],
        "all_replied": all(line["replied"] == line["sent"] for line in lines),
    }


#: requests an idle SuperNode of flwr 1.42 sends per second: a PullMessages every 3 s
#: (``flwr.supernode.start_client_internal``: ``time.sleep(3)`` when nothing was pulled) and a
#: heartbeat every 20 s on average (``flwr.supercore.heartbeat``: (30 - 5) x U(0.7, 0.9))
IDLE_PULL_SECONDS, HEARTBEAT_SECONDS = 3.0, 20.0


def _settled(pids: list[int], quiet: float = 0.02, window: float = 3.0, timeout: float = 600.0) -> float:
    """Wait until every process in ``pids`` uses under ``quiet`` of a core over ``window`` seconds
    (the SuperNodes started and connected: from then on they only poll); the seconds waited."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        before = [_cpu_seconds(pid) for pid in pids]
        time.sleep(window)
        if all(_cpu_seconds(pid) - b < quiet * window for pid, b in zip(pids, before)):
            return time.monotonic() - began
    raise RuntimeError(f"the SuperNodes did not settle within {timeout:g} s")


def measure_idle(supernodes: int, seconds: float, isolation: str = "warm") -> dict[str, Any]:
    """The SuperLink's CPU over ``seconds`` with ``supernodes`` connected, idle SuperNodes."""
    with _federation(supernodes, isolation) as fed:
        link, nodes = fed.link, fed.nodes
        settle = _settled([n.popen.pid for n in nodes])
        alive = sum(n.popen.poll() is None for n in nodes)
        cpu0, t0 = _cpu_seconds(link.popen.pid), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = _cpu_seconds(link.popen.pid), time.monotonic()
        rss = _rss_mib(link.popen.pid)
        alive = min(alive, sum(n.popen.poll() is None for n in nodes))
    if alive != supernodes:
        raise RuntimeError(f"{supernodes - alive} SuperNodes exited; logs in {fed.run_dir / 'logs'}")
    cores = (cpu1 - cpu0) / (t1 - t0)
    requests = supernodes * (1 / IDLE_PULL_SECONDS + 1 / HEARTBEAT_SECONDS) * (t1 - t0)
    return {
        "supernodes": supernodes, "settle_seconds": round(settle, 1), "idle_seconds": round(t1 - t0, 1),
        "superlink_cpu_seconds": round(cpu1 - cpu0, 2), "superlink_cores": round(cores, 4),
        "superlink_cores_per_device": cores / supernodes if supernodes else None,
        "devices_per_core": supernodes / cores if cores > 0 and supernodes else None,
        "requests_estimated": round(requests),
        "superlink_cpu_ms_per_request": 1000 * (cpu1 - cpu0) / requests if requests else None,
        "requests_per_second_per_core": requests / (cpu1 - cpu0) if cpu1 > cpu0 and requests else None,
        "superlink_rss_mib": round(rss, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--supernodes", type=int, nargs="+", default=[10, 40])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (one more runs first, as warm-up)")
    parser.add_argument("--payload-bytes", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--isolation", default="warm", choices=("warm", "subprocess"))
    parser.add_argument("--idle-seconds", type=float, default=0.0,
                        help="measure the SuperLink's CPU with idle connected SuperNodes for this long instead of "
                             "running rounds")
    parser.add_argument("--out", default="bench/results/superlink_throughput")
    args = parser.parse_args(argv)
    if args.idle_seconds < 0:
        parser.error("--idle-seconds must be >= 0")
    results = []
    for n in args.supernodes:
        if args.idle_seconds:
            result = measure_idle(n, args.idle_seconds, args.isolation)
        else:
            result = measure(n, args.rounds, args.payload_bytes, args.timeout, args.isolation)
        results.append(result)
        print(json.dumps(result), flush=True)
    base = next((r for r in results if args.idle_seconds and r["supernodes"] == 0), None)
    for result in results:
        if base is not None and result["supernodes"] and result["superlink_cores"] > base["superlink_cores"]:
            # what each more connected device adds, the SuperLink's own idle load taken out
            marginal = (result["superlink_cores"] - base["superlink_cores"]) / result["supernodes"]
            per_request = marginal * IDLE_PULL_SECONDS * HEARTBEAT_SECONDS / (IDLE_PULL_SECONDS + HEARTBEAT_SECONDS)
            result.update({"marginal_cores_per_device": marginal, "marginal_devices_per_core": 1 / marginal,
                           "marginal_cpu_ms_per_request": 1000 * per_request,
                           "marginal_requests_per_second_per_core": 1 / per_request})
            print(f"{result['supernodes']} devices: {1 / marginal:,.0f} idle devices per SuperLink core "
                  f"({1 / per_request:,.0f} requests per second per core), the SuperLink's own load taken out",
                  flush=True)
    command = "PYTHONPATH=. .venv/bin/python " + shlex.join(sys.argv)
    record = {"command": command, "date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
