"""What one deployment message costs a device: CPU-seconds and lifetime of every ClientApp process.

Flower 1.41's deployment engine starts a fresh ``flwr-clientapp`` process for every message (its
SuperExec launches one per task; ``supernode/runtime/run_clientapp.py`` runs one and exits), so a
device pays Python, Flower and torch imports on every round besides its training. On one host
running many SuperNodes (benchmarks, tests) those processes share the CPUs, and whether a run is
bound by the CPUs or by the waiting decides what a faster algorithm can gain. This benchmark runs the
product's own deployment path (``server.engines.launch``: a real SuperLink and N SuperNodes on
127.0.0.1) and samples ``/proc`` every ``--interval`` seconds for the run's ClientApp processes
(found by the run's own ``FLWR_HOME`` in their environment): CPU time (user + system) at the last
sample, the process's exact start (``/proc/<pid>/stat`` starttime) and the last time it was seen,
the node it belongs to. A process's CPU and life after its last sample are missed (at most one
interval, a little more for a sweep of ``/proc`` on a busy machine), so figures are lower bounds.

Reported: per node, the first message (it also loads and caches the node's partition) apart from
the later ones; medians of CPU-seconds and lifetime; with ``--stragglers``, the later messages'
lifetimes of slowed and of other nodes (how much slower a slow device really is per message);
the clients' own training time (``train-seconds`` of their replies, the median of each round's
mean); the ClientApps' mean busy cores over the run (their CPU-seconds over the wall time from the
first process's start to the last one seen) against the machine's cores: near the core count,
the run is CPU-bound.

    .venv/bin/python bench/clientapp_cpu.py                          # 4 SuperNodes, 3 rounds (~1 min)
    .venv/bin/python bench/clientapp_cpu.py --supernodes 16 --rounds 6 --algorithm fedbuff:concurrency=16,buffer=8 \
        --stragglers fraction=0.25,slowdown=5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

from fedge.protocol.stragglers import parse_stragglers  # noqa: E402
from fedge.server.local import launch  # noqa: E402
from fedge.server.settings import RunSettings  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def _clientapp(pid: str, home: bytes) -> tuple[float, int, int] | None:
    """(CPU-seconds, node index, start in clock ticks since boot) of a live ClientApp process of
    this run, else None."""
    try:
        if b"flwr-clientapp" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        node_home = next((e for e in environ if e.startswith(b"FLWR_HOME=" + home)), None)
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if node_home is None:
        return None
    node = node_home.rstrip(b"/").rsplit(b"/", 1)[-1]  # <run FLWR_HOME>/supernodes/<i>
    # after the ')' closing the command name, index 0 is field 3 (state): utime, stime, starttime
    # are fields 14, 15 and 22
    return (int(stat[11]) + int(stat[12])) / _TICK, int(node) if node.isdigit() else -1, int(stat[19])


class Sampler(threading.Thread):
    """Polls /proc for the run's ClientApp processes until stopped."""

    def __init__(self, flwr_home: Path, interval: float) -> None:
        super().__init__(daemon=True)
        self.home, self.interval = str(flwr_home).encode(), interval
        # (pid, start tick) -> node, first (its start), last (last seen), cpu; seconds since t0
        self.seen: dict[tuple[int, int], dict[str, Any]] = {}
        self.halt = threading.Event()
        self.t0 = _uptime()  # the clock /proc/<pid>/stat starttime counts on

    def run(self) -> None:
        while not self.halt.is_set():
            for pid in (p for p in os.listdir("/proc") if p.isdigit()):
                found = _clientapp(pid, self.home)
                if found is not None:
                    cpu, node, start = found
                    entry = self.seen.setdefault((int(pid), start), {"node": node, "first": start / _TICK - self.t0})
                    entry.update(last=_uptime() - self.t0, cpu=cpu)
            self.halt.wait(self.interval)


def summarize(seen: dict[tuple[int, int], dict[str, Any]], slow_nodes: int) -> dict[str, Any]:
    processes = sorted(seen.values(), key=lambda p: p["first"])
    firsts, later, done = [], [], set()
    for p in processes:
        (later if p["node"] in done else firsts).append(p)
        done.add(p["node"])
    span = (max(p["last"] for p in processes) - min(p["first"] for p in processes)) if processes else 0.0

    def med(items: list[dict[str, Any]], key: str) -> float | None:
        values = [p[key] if key == "cpu" else p["last"] - p["first"] for p in items]
        return statistics.median(values) if values else None

    total = sum(p["cpu"] for p in processes)
    slow = [p for p in later if p["node"] < slow_nodes]
    fast = [p for p in later if p["node"] >= slow_nodes]
    return {
        "processes": len(processes), "nodes": len(done),
        "first_cpu_median": med(firsts, "cpu"), "first_life_median": med(firsts, "life"),
        "later_cpu_median": med(later, "cpu"), "later_life_median": med(later, "life"),
        "later_cpu_min": min((p["cpu"] for p in later), default=None),
        "later_cpu_max": max((p["cpu"] for p in later), default=None),
        "cpu_total": total, "span_seconds": span, "busy_cores": total / span if span else None,
        "slow_later_life_median": med(slow, "life") if slow_nodes else None,
        "other_later_life_median": med(fast, "life") if slow_nodes else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--supernodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--algorithm", default="fedavg")
    parser.add_argument("--stragglers", default="none", help="run setting: 'fraction=F,slowdown=S' slows the first "
                        "ceil(F x supernodes) nodes")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between /proc samples")
    parser.add_argument("--out", help="output path without suffix (default: bench/results/clientapp-cpu)")
    args = parser.parse_args()
    if args.supernodes < 1 or args.rounds < 1 or args.interval <= 0:
        parser.error("--supernodes and --rounds must be >= 1, --interval > 0")
    try:
        fraction, factor = parse_stragglers(args.stragglers)
    except ValueError as err:
        parser.error(str(err))
    slow_nodes = math.ceil(fraction * args.supernodes) if factor != 1.0 else 0
    command = shlex.join([".venv/bin/python", "bench/clientapp_cpu.py", *sys.argv[1:]])
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fedge-bench-clientapp-") as tmp:
        run_dir = Path(tmp) / "run"
        settings = RunSettings(algorithm=args.algorithm, rounds=args.rounds, clients_per_round=args.supernodes,
                               local_epochs=args.local_epochs, stragglers=args.stragglers, run_dir=str(run_dir))
        sampler = Sampler((run_dir / "flwr-home").resolve(), args.interval)
        sampler.start()
        try:
            result = launch(settings, engine="deployment", num_supernodes=args.supernodes, timeout=3600)
        finally:
            sampler.halt.set()
            sampler.join()
    if not result.summary:
        print("the run did not finish; see its logs", file=sys.stderr)
        return 1
    summary = summarize(sampler.seen, slow_nodes)
    if not summary["processes"]:
        print("no flwr-clientapp process of this run was seen: nothing measured", file=sys.stderr)
        return 1
    trained = [r["client_train_seconds"] for r in result.rows if r.get("client_train_seconds")]
    summary["train_seconds_median"] = statistics.median(trained) if trained else None
    cores = os.cpu_count() or 1
    header = (f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()}, {cores} logical CPUs "
              f"(load average {load_start:.2f} at start): {args.supernodes} SuperNodes on 127.0.0.1, "
              f"{args.algorithm}, {args.rounds} rounds/versions of {args.local_epochs} local epochs, digits, "
              f"stragglers {args.stragglers}; "
              f"`{command}`")
    fmt = lambda v, unit="s": "-" if v is None else f"{v:.2f} {unit}".strip()  # noqa: E731
    table = "\n".join([
        "| ClientApp processes | a node's first message: CPU / lifetime | later messages: CPU (min-max) / lifetime | "
        "later lifetime: slowed / other nodes | clients' training | busy cores (ClientApps) |",
        "|---|---|---|---|---|---|",
        f"| {summary['processes']} on {summary['nodes']} nodes | {fmt(summary['first_cpu_median'])} / "
        f"{fmt(summary['first_life_median'])} | {fmt(summary['later_cpu_median'])} "
        f"({fmt(summary['later_cpu_min'])}-{fmt(summary['later_cpu_max'])}) / {fmt(summary['later_life_median'])} | "
        f"{fmt(summary['slow_later_life_median'])} / {fmt(summary['other_later_life_median'])} | "
        f"{fmt(summary['train_seconds_median'])} | {fmt(summary['busy_cores'], '')} of {cores} |",
    ])
    print(header + "\n\n" + table + "\n\nmedians; CPU = user + system of each flwr-clientapp process")
    out = Path(args.out or ROOT / "bench" / "results" / "clientapp-cpu")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(header + "\n\n" + table + "\n")
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu_count": cores,
         "load_average_at_start": load_start, "args": vars(args), "summary": summary,
         "round_seconds": [r.get("seconds") for r in result.rows],
         "processes": sorted(sampler.seen.values(), key=lambda p: p["first"])}, indent=2) + "\n")
    print(f"reproduce: {command}\nwrote {out}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
