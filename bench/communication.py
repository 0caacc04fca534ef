"""Federated runs side by side: the same task, clients, rounds and seeds; only the uplink codec changes.

Presets:
* ``demo``  - the demo setting (10 clients, 30 rounds) for the default codec and its neighbours.
* ``suite`` - issue 3's comparison: 20 clients, Dirichlet(0.5), every codec family.
* ``fashion`` - the same on Fashion-MNIST (12,000 training / 2,000 test images), when Debian's
  ``dataset-fashion-mnist`` is installed; skipped with a message otherwise.

For each configuration and seed: final held-out accuracy and loss, total uplink and downlink bytes
(real payloads; downlink is the fp32 model sent to every sampled client), compression ratio against
the fp32-equivalent uplink, and the first round (and cumulative uplink MB) at which held-out
accuracy reached ``--target``. Prints a markdown table (mean ± std over seeds) and writes JSON
with the command that produced it.

    .venv/bin/python bench/communication.py --preset suite --seeds 42 43 44
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness.seeds import client_slots, default_workers, interval, map_runs, paired, seeds_row, verdict  # noqa: E402
from fedge.server.local import launch  # noqa: E402
from fedge.server.settings import RunSettings  # noqa: E402

PRESETS = {
    "demo": {
        "clients": 10, "rounds": 30,
        "configs": [
            ("none", True), ("fp16", True), ("qsgd:bits=8", True), ("qsgd:bits=4", True),
            ("qsgd:bits=4,norm=l2", True), ("qsgd:bits=4,norm=l2", False), ("qsgd:bits=2", True),
        ],
    },
    "fashion": {
        "task": "fashion:train_samples=12000,test_samples=2000", "clients": 20, "rounds": 20, "local_epochs": 2,
        "target": 0.75,
        # issue 3's list; the run recorded in bench/results/communication-fashion.md covers 7 of them
        # (`--only`), one seed: about 2 minutes per run here
        "configs": [
            ("none", True), ("fp16", True), ("qsgd:bits=8", True), ("qsgd:bits=4", True), ("qsgd:bits=2", True),
            ("terngrad", True), ("onebit", True), ("sign", True), ("topk:ratio=0.01,sample=0.05+qsgd:bits=4", True),
            ("topk:ratio=0.001,sample=0.05+qsgd:bits=4", True), ("randk:ratio=0.01,shared=true", True),
            ("dgc:ratio=0.01,sample=0.05+qsgd:bits=4", True), ("zstd:level=3+qsgd:bits=4", True),
        ],
    },
    "suite": {
        "clients": 20, "rounds": 40,
        "configs": [
            ("none", True), ("fp16", True), ("qsgd:bits=8", True), ("qsgd:bits=4", True),
            ("qsgd:bits=2", True), ("terngrad", True), ("onebit", True), ("sign", True),
            ("topk:ratio=0.01", True), ("topk:ratio=0.01,sample=0.05+qsgd:bits=4", True),
            ("topk:ratio=0.02,sample=0.05+qsgd:bits=4", True),
            ("topk:ratio=0.001,sample=0.05+qsgd:bits=4", True), ("randk:ratio=0.01,shared=true", True),
            ("dgc:ratio=0.01,sample=0.05+qsgd:bits=4", True), ("dgc:ratio=0.001,sample=0.05+qsgd:bits=4", True),
            # issue 22's moonshot: no sparsity warm-up (its dense first rounds are a third of the uplink)
            ("dgc:ratio=0.007,sample=0.05,warmup=0+qsgd:bits=4", True),
        ],
    },
}


def run_one(codec: str, ef: bool, seed: int, clients: int, rounds: int, target: float, run_dir: str,
            task: str = "digits", local_epochs: int = 5, workers: int = 1) -> dict:
    settings = RunSettings(codec=codec, error_feedback=ef, rounds=rounds, clients_per_round=clients,
                           seed=seed, run_dir=run_dir, task=task, local_epochs=local_epochs)
    result = launch(settings, engine="simulation", num_supernodes=clients, timeout=3600,
                    parallel_clients=client_slots(workers))
    rows, summary = result.rows, result.summary
    reached = next((r for r in rows if r["accuracy"] >= target), None)
    uplink_at = sum(r["uplink_bytes"] for r in rows if reached and r["round"] <= reached["round"])
    return {
        "codec": codec, "error_feedback": ef, "seed": seed, "model_digest": summary.get("model_digest"),
        "accuracy": summary["final_accuracy"], "loss": summary["final_loss"],
        "uplink_bytes": summary["uplink_bytes"], "downlink_bytes": summary["downlink_bytes"],
        "uplink_fp32_bytes": summary["uplink_fp32_bytes"], "ratio": summary["compression_ratio"],
        "round_to_target": reached["round"] if reached else None,
        "uplink_mb_to_target": uplink_at / 1e6 if reached else None,
    }


def _job(job: tuple) -> dict:
    """One (codec, seed) run, in a worker process of :func:`map_runs`."""
    run = run_one(*job)
    print(f"{run['codec']} ef={run['error_feedback']} seed={run['seed']}: {100 * run['accuracy']:.2f}% "
          f"ratio {run['ratio']:.1f}x", file=sys.stderr, flush=True)
    return run


def _mean_std(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--rounds", type=int, help="override the preset's rounds")
    parser.add_argument("--target", type=float, default=None,
                        help="accuracy for rounds-to-target (default: the preset's, 0.95 on digits)")
    parser.add_argument("--only", nargs="*", help="run only these codec specs")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="runs at once, each in its own processes at one thread (default: one per core); "
                             "a run's result does not depend on it")
    parser.add_argument("--out", help="JSON output (default bench/results/communication-<preset>.json)")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    task = preset.get("task", "digits")
    if task.startswith("fashion"):
        from fedge.tasks import fashion_mnist

        if not fashion_mnist.available():
            print(f"skipped: Fashion-MNIST is not installed in {fashion_mnist.data_dir()} "
                  "(apt-get install dataset-fashion-mnist)")
            return
    rounds = args.rounds or preset["rounds"]
    args.target = args.target if args.target is not None else preset.get("target", 0.95)
    configs = [c for c in preset["configs"] if not args.only or c[0] in args.only]
    command = " ".join([Path(sys.executable).name, *sys.argv])
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(codec, ef, seed, preset["clients"], rounds, args.target, f"{tmp}/run{i}-{seed}", task,
                 preset.get("local_epochs", 5), args.workers)
                for i, (codec, ef) in enumerate(configs) for seed in args.seeds]
        runs = map_runs(_job, jobs, args.workers)
    print(f"\nMeasured {time.strftime('%Y-%m-%d')} on {platform.machine()}: {task}, Dirichlet(0.5), "
          f"{preset['clients']} clients (all sampled), {rounds} rounds, seeds {args.seeds}. Command: `{command}`\n")
    print(f"| codec | EF | held-out accuracy % | uplink MB | downlink MB | uplink vs fp32 | round to {args.target:.0%} | "
          f"uplink MB to {args.target:.0%} |")
    print("|---|---|---|---|---|---|---|---|")
    for codec, ef in configs:
        group = [r for r in runs if r["codec"] == codec and r["error_feedback"] == ef]
        reached = [r for r in group if r["round_to_target"] is not None]
        to_round = _mean_std([r["round_to_target"] for r in reached], digits=1) if len(reached) == len(group) else (
            f"{len(reached)}/{len(group)} runs")
        to_mb = _mean_std([r["uplink_mb_to_target"] for r in reached], digits=3) if reached else "-"
        print(f"| `{codec}` | {'yes' if ef else 'no'} | {_mean_std([r['accuracy'] for r in group], 100)} | "
              f"{_mean_std([r['uplink_bytes'] for r in group], 1e-6, 3)} | "
              f"{_mean_std([r['downlink_bytes'] for r in group], 1e-6, 1)} | "
              f"{statistics.mean(r['ratio'] for r in group):.1f}x | {to_round} | {to_mb} |")
    seeded = _over_seeds(runs, configs, args.seeds)
    out = Path(args.out or Path(__file__).parent / "results" / f"communication-{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d"),
                               "machine": platform.platform(), "seeds": seeded, "runs": runs}, indent=2) + "\n")


def _over_seeds(runs: list[dict], configs: list[tuple[str, bool]], seeds: list[int]) -> list[dict]:
    """Final accuracy per configuration with its 95% interval, and paired by seed against fp32
    (``none`` with error feedback) when that ran: printed, and returned for the JSON."""
    def values(codec: str, ef: bool) -> list[float]:
        by_seed = {r["seed"]: r["accuracy"] for r in runs if r["codec"] == codec and r["error_feedback"] == ef}
        return [by_seed[s] for s in seeds]

    base = values("none", True) if ("none", True) in configs else None
    print(f"\nOver seeds {seeds} (95% interval, Student t; differences paired by seed against fp32):\n")
    print("| codec | EF | final held-out accuracy | paired difference vs fp32 |\n|---|---|---|---|")
    rows = []
    for codec, ef in configs:
        own = values(codec, ef)
        against = None if base is None or (codec, ef) == ("none", True) else base
        rows.append(seeds_row(codec, own, against, error_feedback=ef))
        diff = "-" if against is None else verdict(paired(own, against))
        print(f"| `{codec}` | {'yes' if ef else 'no'} | {interval(own).text(scale=100, unit='%')} | {diff} |")
    return rows


if __name__ == "__main__":
    main()
