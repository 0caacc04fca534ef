"""Same seed, same run: one setting run several times with one seed, each time with the CPU loaded by
another process, on Flower's simulation engine (as ``fedge demo``). Every run must end with the same
final accuracy and the same model digest, and write the same ``metrics.jsonl`` apart from its
wall-time fields; the table says whether they did.

The default setting is the one whose runs parted most before the coordinator's sums were exact and
nodes were named by partition (seed 42, four runs: 96.67%, 95.28%, 91.39%, 89.72%): 50 clients, 5 a
round, 60 rounds, DGC 1% + 4-bit QSGD with error feedback up, a 2% lattice down, the sparse mean and
an exponential model average.

    .venv/bin/python bench/same_seed.py                       # 4 runs of the setting above, CPU loaded
    .venv/bin/python bench/same_seed.py --repeats 2 --rounds 3 --clients 10 --per-round 4 --no-load
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

from fedge.server.local import launch
from fedge.server.run.metrics_row import without_timing
from fedge.server.settings import RunSettings

SETTING = {"codec": "dgc:ratio=0.01,sample=0.05+qsgd:bits=4", "downlink_codec": "lattice:ratio=0.02",
           "aggregator": "sparse-mean", "model_average": "ema:decay=0.8"}


def _spin(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    """Another process's load: busy arithmetic until told to stop."""
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x = (x * 31 + i) % 1_000_003


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--no-load", action="store_true", help="run without the CPU-loading process")
    parser.add_argument("--out", default="bench/results/same-seed")
    args = parser.parse_args(argv)
    runs = []
    for repeat in range(args.repeats):
        stop = multiprocessing.Event()
        load = None if args.no_load else multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
        if load is not None:
            load.start()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                settings = RunSettings(rounds=args.rounds, clients_per_round=args.per_round, seed=args.seed,
                                       run_dir=str(Path(tmp) / "run"), **SETTING)  # type: ignore[arg-type]
                started = time.perf_counter()
                result = launch(settings, engine="simulation", num_supernodes=args.clients, timeout=7200)
                seconds = time.perf_counter() - started
        finally:
            stop.set()
            if load is not None:
                load.join(timeout=10)
        assert result.summary is not None, "the run did not finish"
        runs.append({"repeat": repeat + 1, "accuracy": result.summary["final_accuracy"],
                     "model_digest": result.summary["model_digest"], "seconds": seconds,
                     "rows": [without_timing(row) for row in result.rows]})
        print(f"run {repeat + 1}: {100 * runs[-1]['accuracy']:.2f}% digest {runs[-1]['model_digest']} "
              f"in {seconds:.0f} s", flush=True)
    same = all(r["rows"] == runs[0]["rows"] and r["model_digest"] == runs[0]["model_digest"] for r in runs)
    command = ".venv/bin/python " + shlex.join(sys.argv)
    lines = [f"# Same seed, same run ({time.strftime('%Y-%m-%d %H:%M')}, {platform.node()})", "", f"    {command}", "",
             f"{args.clients} clients, {args.per_round} a round, {args.rounds} rounds, seed {args.seed}, "
             f"{'no other load' if args.no_load else 'another process loading a core'}; settings {SETTING}.", "",
             "| run | final accuracy | model digest | wall s |", "|---|---|---|---|",
             *[f"| {r['repeat']} | {100 * r['accuracy']:.2f}% | `{r['model_digest']}` | {r['seconds']:.0f} |" for r in runs],
             "", f"metrics.jsonl (wall-time fields aside) and digest identical in every run: **{'yes' if same else 'NO'}**"]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"command": command, "same": same,
                                                    "runs": [{k: v for k, v in r.items() if k != "rows"} for r in runs]},
                                                   indent=1) + "\n", encoding="utf-8")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
