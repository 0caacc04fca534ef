"""Many stateful clients on one box: seconds per round, peak memory of every process, state per client.

One federated run on Flower's simulation engine with ``--clients`` simulated devices, ``--per-round``
sampled per round, error feedback on every device (its residual or DGC memory lives in the device's
``Context``, which Flower keeps in the simulation process for every node). While it runs, the
resident memory (VmRSS from /proc) of every process this benchmark started (SuperLink, ``flwr run``,
the simulation process, Ray's GCS, raylet and workers) is sampled every half second; the peak of
their sum is reported (an upper bound: pages shared between processes count once per process).

The per-client state is counted exactly from its size (model elements x bytes per stored value),
and 10,000 / 100,000 clients are projected from it and the measured fixed cost.

    .venv/bin/python bench/scale.py --clients 1000 --per-round 100 --rounds 20 --task fashion \\
        --memory-storage fp32
    .venv/bin/python bench/scale.py ... --memory-storage int8     # compact state, same run otherwise
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

from fedge.compression import make_codec
from fedge.server.local import launch
from fedge.server.settings import RunSettings
from fedge.tasks import make_task, numel_of

BYTES_PER_VALUE = {"fp32": 4, "fp16": 2, "int8": 1 + 4 / 4096}


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            tree.setdefault(int(fields[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return tree


def _rss_kib(pid: int) -> tuple[str, int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            status = dict(line.split(":", 1) for line in handle if ":" in line)
        return status.get("Name", "?").strip(), int(status.get("VmRSS", "0 kB").split()[0])
    except (OSError, ValueError):
        return "?", 0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/<pid>/stat, clock ticks)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class MemorySampler(threading.Thread):
    """Peak summed RSS of this process's descendants, each process name's peak, and the CPU seconds
    of each process name (the last reading of each process, summed by name)."""

    def __init__(self, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak_total, self.peaks = interval, 0, {}
        self.cpu: dict[int, tuple[str, float]] = {}
        self.done = threading.Event()

    def cpu_by_name(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, seconds in self.cpu.values():
            out[name] = out.get(name, 0.0) + seconds
        return out

    def run(self) -> None:
        root = os.getpid()
        while not self.done.is_set():
            tree, total = _children(), 0
            stack = list(tree.get(root, []))
            while stack:
                pid = stack.pop()
                stack.extend(tree.get(pid, []))
                name, kib = _rss_kib(pid)
                self.cpu[pid] = (name, _cpu_seconds(pid))
                total += kib
                self.peaks[name] = max(self.peaks.get(name, 0), kib)
            self.peak_total = max(self.peak_total, total)
            time.sleep(self.interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--task", default="fashion")
    parser.add_argument("--codec", default="qsgd:bits=4")
    parser.add_argument("--downlink", default="none")
    parser.add_argument("--memory-storage", default="fp32", choices=sorted(BYTES_PER_VALUE))
    parser.add_argument("--partitioning", default="iid")
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--secure-aggregation", default="none",
                        help="e.g. 'secagg:bits=8,clip=0.2': the coordinator's secure-aggregation cost at this scale")
    parser.add_argument("--out", default="bench/results/scale")
    args = parser.parse_args(argv)
    numel = numel_of(make_task(args.task).build_model().state_dict())
    codec = make_codec(args.codec)
    memory_tensors = len(codec.make_memory(codec.for_round(1, 0), numel, None).state_dict())  # residual; DGC: u, v
    sampler = MemorySampler()
    sampler.start()
    with tempfile.TemporaryDirectory() as tmp:
        settings = RunSettings(task=args.task, codec=args.codec, downlink_codec=args.downlink, rounds=args.rounds,
                               clients_per_round=args.per_round, memory_storage=args.memory_storage,
                               partitioning=args.partitioning, local_epochs=args.local_epochs, seed=args.seed,
                               run_dir=str(Path(tmp) / "run"), round_timeout=3600,
                               secure_aggregation=args.secure_aggregation)
        started = time.perf_counter()
        result = launch(settings, engine="simulation", num_supernodes=args.clients, timeout=4 * 3600)
        wall = time.perf_counter() - started
    sampler.done.set()
    sampler.join()
    rows = result.rows
    per_round = [r["seconds"] for r in rows]
    state_per_client = memory_tensors * numel * BYTES_PER_VALUE[args.memory_storage]
    clients_with_state = min(args.clients, args.per_round * args.rounds)
    command = "PYTHONPATH=. .venv/bin/python " + shlex.join(sys.argv)
    summary = {
        "command": command, "date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
        "clients": args.clients, "per_round": args.per_round, "rounds": args.rounds, "task": args.task,
        "numel": numel, "codec": args.codec, "memory_storage": args.memory_storage,
        "secure_aggregation": args.secure_aggregation,
        "clients_used_per_round": [r["clients_used"] for r in rows],
        "seconds_per_round": per_round,
        "final_accuracy": result.summary["final_accuracy"], "best_accuracy": max(r["accuracy"] for r in rows),
        "seconds_per_round_median": sorted(per_round)[len(per_round) // 2], "wall_seconds": wall,
        "peak_rss_total_mib": sampler.peak_total / 1024,
        "peak_rss_by_process_mib": {k: v / 1024 for k, v in sorted(sampler.peaks.items(), key=lambda kv: -kv[1])[:8]},
        # flwr-simulation runs the ServerApp (the coordinator) and the simulation engine's driver;
        # the ClientApps run in Ray's actors
        "cpu_seconds_by_process": {k: round(v, 1) for k, v in
                                   sorted(sampler.cpu_by_name().items(), key=lambda kv: -kv[1])[:8]},
        "state_bytes_per_client": state_per_client, "clients_with_state_at_most": clients_with_state,
        "projected_state_gib": {str(n): n * state_per_client / 2**30 for n in (1_000, 10_000, 100_000)},
    }
    text = json.dumps(summary, indent=1)
    print(text)
    out = Path(args.out + f"-{args.memory_storage}" + ("-secagg" if args.secure_aggregation != "none" else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
