"""What one deployment message costs a device: CPU-seconds and lifetime of every ClientApp process.

Flower 1.41's deployment engine starts a fresh ``flwr-clientapp`` process for every message (its
SuperExec launches one per task; ``supernode/runtime/run_clientapp.py`` runs one and exits), so a
device pays Python, Flower and torch imports on every round besides its training. On one host
running many SuperNodes (benchmarks, tests) those processes share the CPUs, and whether a run is
bound by the CPUs or by the waiting decides what a faster algorithm can gain. This benchmark runs the
product's own deployment path (``server.engines.launch``: a real SuperLink and N SuperNodes on
127.0.0.1) and samples ``/proc`` every ``--interval`` seconds for the run's ClientApp processes
(found by the run's own ``FLWR_HOME`` in their environment): CPU time (user + system) at the last
sample, first and last time seen, the node it belongs to. A process's CPU after its last sample
is missed (at most one interval of its life), so figures are lower bounds by that much.

Reported: per node, the first message (it also loads and caches the node's partition) apart from
the later ones; medians of CPU-seconds and lifetime; the ClientApps' mean busy cores over the
run (their CPU-seconds over the wall time from the first to the last process seen) against the
machine's cores: near the core count, the run is CPU-bound.

    .venv/bin/python bench/clientapp_cpu.py                          # 4 SuperNodes, 3 rounds (~1.5 min)
    .venv/bin/python bench/clientapp_cpu.py --supernodes 16 --rounds 3 --algorithm fedbuff:concurrency=16,buffer=8
"""

from __future__ import annotations

import argparse
import json
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
sys.path.insert(0, str(ROOT))

from server.engines import launch  # noqa: E402
from server.settings import RunSettings  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def _clientapp(pid: str, home: bytes) -> tuple[float, int] | None:
    """(CPU-seconds, node index) of a live ClientApp process of this run, else None."""
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
    return (int(stat[11]) + int(stat[12])) / _TICK, int(node) if node.isdigit() else -1


class Sampler(threading.Thread):
    """Polls /proc for the run's ClientApp processes until stopped."""

    def __init__(self, flwr_home: Path, interval: float) -> None:
        super().__init__(daemon=True)
        self.home, self.interval = str(flwr_home).encode(), interval
        self.seen: dict[int, dict[str, Any]] = {}  # pid -> node, first, last, cpu
        self.halt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.halt.is_set():
            now = time.monotonic() - self.t0
            for pid in (p for p in os.listdir("/proc") if p.isdigit()):
                found = _clientapp(pid, self.home)
                if found is not None:
                    entry = self.seen.setdefault(int(pid), {"node": found[1], "first": now})
                    entry.update(last=now, cpu=found[0])
            self.halt.wait(self.interval)


def summarize(seen: dict[int, dict[str, Any]]) -> dict[str, Any]:
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
    return {
        "processes": len(processes), "nodes": len(done),
        "first_cpu_median": med(firsts, "cpu"), "first_life_median": med(firsts, "life"),
        "later_cpu_median": med(later, "cpu"), "later_life_median": med(later, "life"),
        "later_cpu_min": min((p["cpu"] for p in later), default=None),
        "later_cpu_max": max((p["cpu"] for p in later), default=None),
        "cpu_total": total, "span_seconds": span, "busy_cores": total / span if span else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--supernodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--algorithm", default="fedavg")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between /proc samples")
    parser.add_argument("--out", help="output path without suffix (default: bench/results/clientapp-cpu)")
    args = parser.parse_args()
    if args.supernodes < 1 or args.rounds < 1 or args.interval <= 0:
        parser.error("--supernodes and --rounds must be >= 1, --interval > 0")
    command = shlex.join([".venv/bin/python", "bench/clientapp_cpu.py", *sys.argv[1:]])
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fedge-bench-clientapp-") as tmp:
        run_dir = Path(tmp) / "run"
        settings = RunSettings(algorithm=args.algorithm, rounds=args.rounds, clients_per_round=args.supernodes,
                               local_epochs=args.local_epochs, run_dir=str(run_dir))
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
    summary = summarize(sampler.seen)
    cores = os.cpu_count() or 1
    header = (f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()}, {cores} logical CPUs "
              f"(load average {load_start:.2f} at start): {args.supernodes} SuperNodes on 127.0.0.1, "
              f"{args.algorithm}, {args.rounds} rounds/versions of {args.local_epochs} local epochs, digits; "
              f"`{command}`")
    fmt = lambda v, unit="s": "-" if v is None else f"{v:.2f} {unit}".strip()  # noqa: E731
    table = "\n".join([
        "| ClientApp processes | a node's first message: CPU / lifetime | later messages: CPU (min-max) / lifetime | "
        "busy cores (ClientApps) |",
        "|---|---|---|---|",
        f"| {summary['processes']} on {summary['nodes']} nodes | {fmt(summary['first_cpu_median'])} / "
        f"{fmt(summary['first_life_median'])} | {fmt(summary['later_cpu_median'])} "
        f"({fmt(summary['later_cpu_min'])}-{fmt(summary['later_cpu_max'])}) / {fmt(summary['later_life_median'])} | "
        f"{fmt(summary['busy_cores'], '')} of {cores} |",
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
