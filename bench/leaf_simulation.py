"""Beyond one SuperLink with the leaves simulated: a deployed root over L leaves whose devices run
under Flower's Simulation Engine, as the devices grow, on Flower's own processes on 127.0.0.1.

Each run is ``fedge local-cluster --leaves L --leaf-engine simulation``: the root's SuperLink and
ServerApp and its L bridge SuperNodes are a deployment; each leaf is a SuperLink in
``--simulation`` mode with its own Ray instance, stepping a sample of its devices per root round
(stateful: a device keeps its error-feedback memory between the steps it is sampled in). Per run
it reports what the root handles per round (replies, ingress bytes: the encoded updates its
bridges sent), the root's own CPU per round (its SuperLink, SuperExec and ServerApp processes,
read from ``/proc``; round 1, which includes their start, is left out), the wall time per round,
the whole installation's peak memory (every process of the run, root and leaves, Ray's included,
plus this launching process: the sum of their RSS and of their PSS, sampled every second) and the
held-out accuracy after the last round.

    .venv/bin/python bench/leaf_simulation.py --devices 16 100 1000 --per-round 16 --rounds 4
    FEDGE_FASHION_MNIST_DIR=... .venv/bin/python bench/leaf_simulation.py --task fashion --devices 10000 \\
        --per-round 100 --rounds 30 --out bench/results/leaf-simulation-10k.json
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.clientapp_cpu import process_cpu, process_memory  # noqa: E402
from bench.sigterm import stop_on_sigterm  # noqa: E402
from fedge.launcher.processes import processes_with_env  # noqa: E402
from fedge.server.local import launch  # noqa: E402
from fedge.server.settings import RunSettings  # noqa: E402

_ROOT_ROLES = (b"flower-superlink", b"flower-superexec", b"flwr-serverapp")


def root_cpu(home: Path) -> float:
    """CPU-seconds so far of the root's coordinator processes: those whose FLWR_HOME is the root's
    and whose command is its SuperLink, SuperExec or ServerApp (not its bridges, which run on the
    leaves' hosts in a deployment, nor ``flwr run``)."""
    total = 0.0
    for pid in processes_with_env("FLWR_HOME", str(home)):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(role in cmdline for role in _ROOT_ROLES):
            total += process_cpu(pid)
    return total


class MemorySampler(threading.Thread):
    """Every ``interval`` s, the sum of RSS and of PSS (MiB) over every process of the run (its
    FLWR_HOME under ``run_dir``) and this one; keeps the peaks."""

    def __init__(self, run_dir: Path, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.interval = run_dir, interval
        self.peak_rss = self.peak_pss = 0.0
        self.peak_processes = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            pids = [*processes_with_env("FLWR_HOME", str(self.run_dir), under=True), os.getpid()]
            sizes = [process_memory(str(pid)) for pid in pids]
            rss, pss = sum(s[0] for s in sizes), sum(s[1] for s in sizes)
            if pss > self.peak_pss:
                self.peak_rss, self.peak_pss, self.peak_processes = rss, pss, len(pids)


def one(devices: int, args: argparse.Namespace) -> dict:
    per_leaf = max(1, args.per_round // args.leaves) if args.per_round else 0
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        settings = RunSettings(task=args.task, rounds=args.rounds, seed=args.seed, local_epochs=args.local_epochs,
                               clients_per_round=args.leaves, partitioning="iid", codec=args.codec,
                               wait_for_nodes=240.0, round_timeout=args.round_timeout, run_dir=str(run_dir))
        marks: list[tuple[int, float, float]] = []  # (round, root CPU-s, monotonic) as each row lands

        def on_row(row: dict) -> None:
            marks.append((row["round"], root_cpu(run_dir / "flwr-home"), time.monotonic()))
            print(f"  N={devices} round {row['round']}: accuracy {row['accuracy']:.3f}", flush=True)

        sampler = MemorySampler(run_dir)
        sampler.start()
        started = time.monotonic()
        try:
            result = launch(settings, engine="deployment", num_supernodes=devices, leaves=args.leaves,
                            leaf_engine="simulation", leaf_sample=per_leaf, on_row=on_row, timeout=args.timeout)
        finally:
            sampler.done.set()
            sampler.join()
        wall = time.monotonic() - started
        leaf_rows = [json.loads(line) for line in (run_dir / "leaf-0" / "metrics.jsonl").read_text().splitlines()]
    rows = result.rows
    if len(rows) != args.rounds:
        raise SystemExit(f"N={devices}: {len(rows)} of {args.rounds} rounds")
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]  # rounds 2..R
    walls = [b[2] - a[2] for a, b in zip(marks, marks[1:])]
    return {"devices": devices, "leaves": args.leaves, "per_leaf": per_leaf or devices // args.leaves,
            "root_replies_per_round": statistics.mean(r["clients_used"] for r in rows),
            "root_ingress_bytes_per_round": statistics.mean(r["uplink_bytes"] for r in rows),
            "root_cpu_s_per_round": statistics.median(cpu) if cpu else None,
            "wall_s_per_round": statistics.median(walls) if walls else None,
            "leaf0_devices_per_step": statistics.mean(r["clients_used"] for r in leaf_rows),
            "peak_rss_mib": sampler.peak_rss, "peak_pss_mib": sampler.peak_pss,
            "peak_processes": sampler.peak_processes, "final_accuracy": rows[-1]["accuracy"],
            "wall_seconds": wall}


def main(argv: list[str] | None = None) -> None:
    stop_on_sigterm()  # a killed benchmark stops every process it started
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--devices", type=int, nargs="+", default=[16, 100, 1000])
    parser.add_argument("--leaves", type=int, default=2)
    parser.add_argument("--per-round", type=int, default=16,
                        help="devices per root round over all leaves (each leaf samples its share; 0: all)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--codec", default="qsgd:bits=4,bucket=512,norm=max",
                        help="the devices' uplink codec, and the leaves' to the root")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--round-timeout", type=float, default=600.0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/leaf-simulation.json"))
    args = parser.parse_args(argv)
    if args.rounds < 2:  # a round's CPU and wall time are measured from one round's end to the next's
        parser.error("--rounds must be at least 2: the per-round figures are those of rounds 2..R")
    command = shlex.join([".venv/bin/python", "bench/leaf_simulation.py", *(argv or sys.argv[1:])])
    results = []
    for devices in args.devices:
        results.append(one(devices, args))
        print(results[-1], flush=True)
    print(f"\n{args.task}, {args.leaves} simulated leaves under a deployed root, {args.per_round or 'all'} devices "
          f"per round, {args.rounds} rounds, codec {args.codec}")
    print("| devices | per leaf and step | root replies / round | root ingress bytes / round | root CPU s / round | "
          "wall s / round | peak memory, all processes (PSS; RSS sum) | processes | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['devices']:,} | {r['leaf0_devices_per_step']:g} | {r['root_replies_per_round']:g} | "
              f"{r['root_ingress_bytes_per_round']:,.0f} | {r['root_cpu_s_per_round']:.2f} | "
              f"{r['wall_s_per_round']:.1f} | {r['peak_pss_mib']:,.0f} MiB ({r['peak_rss_mib']:,.0f} MiB) | "
              f"{r['peak_processes']} | {r['final_accuracy']:.1%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d %H:%M"),
                                    "machine": platform.platform(), "cores": os.cpu_count(),
                                    "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}; reproduce: {command}")


if __name__ == "__main__":
    main()
