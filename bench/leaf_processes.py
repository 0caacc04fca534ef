"""Two tiers against one, on Flower's own processes on 127.0.0.1, side by side in one invocation.

For each seed: a flat run (one SuperLink, N device SuperNodes, every device every round) and a
two-tier run (``fedge local-cluster --leaves L``: a root SuperLink whose L nodes are bridges, each to
a leaf SuperLink with N/L device SuperNodes and a leaf coordinator that steps all its devices per
root round), same task, settings and seed, interleaved. Reports each run's held-out accuracy (final
and best), wall time and the root's ingress bytes per round (the flat coordinator's: every device's
update; the root's: one update per leaf).

    .venv/bin/python bench/leaf_processes.py --supernodes 16 --leaves 2 --rounds 20 --seeds 1 2
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.sigterm import stop_on_sigterm  # noqa: E402
from fedge.server.local import launch  # noqa: E402
from fedge.server.settings import RunSettings  # noqa: E402


def one(mode: str, supernodes: int, leaves: int, rounds: int, seed: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        settings = RunSettings(task=args.task, rounds=rounds, seed=seed, local_epochs=args.local_epochs,
                               clients_per_round=leaves if mode == "leaves" else supernodes, partitioning="iid",
                               codec=args.codec, wait_for_nodes=240.0, round_timeout=300.0,
                               run_dir=str(Path(tmp) / "run"))
        started = time.perf_counter()
        result = launch(settings, engine="deployment", num_supernodes=supernodes,
                        leaves=leaves if mode == "leaves" else 0, timeout=args.timeout)
        wall = time.perf_counter() - started
    rows = result.rows
    if len(rows) != rounds:
        raise SystemExit(f"{mode} seed {seed}: {len(rows)} of {rounds} rounds")
    return {"mode": mode, "seed": seed, "supernodes": supernodes + (leaves if mode == "leaves" else 0),
            "final_accuracy": rows[-1]["accuracy"], "best_accuracy": max(r["accuracy"] for r in rows),
            "root_ingress_bytes_per_round": statistics.mean(r["uplink_bytes"] for r in rows),
            "root_replies_per_round": statistics.mean(r["clients_used"] for r in rows),
            "wall_seconds": wall}


def main(argv: list[str] | None = None) -> None:
    stop_on_sigterm()  # a killed benchmark stops every process it started
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--supernodes", type=int, default=16, help="device SuperNodes (split over the leaves)")
    parser.add_argument("--leaves", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--codec", default="qsgd:bits=4,bucket=512,norm=max",
                        help="the devices' uplink codec, and the leaves' to the root")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/leaf-processes.json"))
    args = parser.parse_args(argv)
    if args.leaves < 1 or args.supernodes % args.leaves:
        parser.error("--supernodes must split evenly over --leaves >= 1")
    command = shlex.join([".venv/bin/python", "bench/leaf_processes.py", *(argv or sys.argv[1:])])
    results = []
    for seed in args.seeds:
        for mode in ("flat", "leaves"):  # interleaved: a drift in the machine's load hits both
            results.append(one(mode, args.supernodes, args.leaves, args.rounds, seed, args))
            print(results[-1], flush=True)
    print(f"\n{args.task}, {args.supernodes} devices, {args.rounds} rounds, codec {args.codec}, seeds {args.seeds}")
    print("| run | SuperNodes | final accuracy (per seed) | mean | best (mean) | root replies / round | "
          "root ingress bytes / round | wall s (mean) |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, label in (("flat", "one SuperLink"), ("leaves", f"root over {args.leaves} leaves")):
        runs = [r for r in results if r["mode"] == mode]
        finals = ", ".join(f"{r['final_accuracy']:.1%}" for r in runs)
        print(f"| {label} | {runs[0]['supernodes']} | {finals} | "
              f"{statistics.mean(r['final_accuracy'] for r in runs):.1%} | "
              f"{statistics.mean(r['best_accuracy'] for r in runs):.1%} | "
              f"{statistics.mean(r['root_replies_per_round'] for r in runs):g} | "
              f"{statistics.mean(r['root_ingress_bytes_per_round'] for r in runs):,.0f} | "
              f"{statistics.mean(r['wall_seconds'] for r in runs):.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d %H:%M"),
                                    "machine": platform.platform(), "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}; reproduce: {command}")


if __name__ == "__main__":
    main()
