"""Both directions compressed, side by side with fp32 FedAvg in one run: uplink, downlink to current
devices, catch-ups for devices that missed versions, snapshots, total ratio and held-out accuracy.

Each configuration is a full federated run on Flower's simulation engine (as ``fedge demo``): the
same task, clients, sampling, rounds and seed; only the codecs change. Bytes are the real encoded
arrays sent (``uplink_bytes``, ``downlink_bytes`` of the metrics rows; the downlink split by kind
from the lattice downlink's own counters). The catch-up histogram groups every catch-up message by
how many versions its device was behind and reports its median size as a fraction of one fp32 model.

    .venv/bin/python bench/bidirectional.py --clients 20 --per-round 20 --rounds 30      # full participation
    .venv/bin/python bench/bidirectional.py --clients 100 --per-round 10 --rounds 100 \\
        --partitioning iid                                                                 # 10% participation
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
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness.seeds import client_slots, default_workers, interval, map_runs, paired, seeds_row, verdict  # noqa: E402
from fedge.server.local import launch  # noqa: E402
from fedge.server.settings import RunSettings  # noqa: E402

DEFAULT_CONFIGS = [
    "fp32;none;none",
    "4-bit up, lattice down;qsgd:bits=4;lattice:ratio=0.05",
    "DGC up, lattice down;dgc:ratio=0.01,sample=0.05+qsgd:bits=4;lattice:ratio=0.05",
]


def run(label: str, codec: str, downlink: str, args: argparse.Namespace, seed: int, extra: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        settings = RunSettings(codec=codec, downlink_codec=downlink, rounds=args.rounds, clients_per_round=args.per_round,
                               task=args.task, partitioning=args.partitioning, local_epochs=args.local_epochs,
                               seed=seed, run_dir=str(Path(tmp) / "run"), **extra)
        started = time.perf_counter()
        result = launch(settings, engine="simulation", num_supernodes=args.clients, timeout=7200,
                        parallel_clients=client_slots(args.workers))
        seconds = time.perf_counter() - started
    rows, summary = result.rows, result.summary
    participations = sum(r["clients_used"] + r["clients_failed"] for r in rows)
    fp32_model = rows[0]["uplink_fp32_bytes"] / max(rows[0]["clients_used"], 1)
    kinds = {k: sum(r.get(f"downlink_{k}_bytes", 0) for r in rows) for k in ("current", "catch_up", "snapshot")}
    counts = {k: sum(r.get(f"downlink_{k}", 0) for r in rows) for k in ("current", "catch_up", "snapshot")}
    behind: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        for versions, size in r.get("downlink_catch_up_sizes", []):
            behind[int(versions)].append(int(size))
    up_to_10 = [s for v, sizes in behind.items() if v <= 10 for s in sizes]
    return {
        "label": label, "codec": codec, "downlink": downlink, "seed": seed, "model_digest": summary.get("model_digest"),
        "accuracy": summary["final_accuracy"], "best_accuracy": max(r["accuracy"] for r in rows),
        "accuracy_by_round": [r["accuracy"] for r in rows],  # a late swing shows here, not in final/best
        "uplink_bytes": summary["uplink_bytes"], "downlink_bytes": summary["downlink_bytes"],
        "downlink_by_kind": kinds, "downlink_counts": counts, "participations": participations,
        "fp32_model_bytes": fp32_model,
        "catch_up_histogram": {str(v): {"count": len(s), "median_bytes": statistics.median(s),
                                        "median_of_fp32": statistics.median(s) / fp32_model}
                               for v, s in sorted(behind.items())},
        "catch_up_median_of_fp32_up_to_10": (statistics.median(up_to_10) / fp32_model) if up_to_10 else None,
        "seconds": seconds,
    }


def _job(job: tuple[argparse.Namespace, int, str]) -> dict:
    """One (seed, configuration) run, in a worker process of :func:`map_runs`."""
    args, seed, config = job
    label, codec, downlink, *own = config.split(";")
    extra = typed_settings(args.settings)
    result = run(label, codec, downlink, args, seed, {**extra, **typed_settings(own[0].split("|") if own else [])})
    result["settings"] = own[0] if own else ""
    print(f"{label} seed {seed}: {100 * result['accuracy']:.2f}% in {result['seconds']:.0f} s", flush=True)
    return result


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["downlink"] == "none" and r["codec"] == "none"), results[0])
    base_total = base["uplink_bytes"] + base["downlink_bytes"]
    lines = ["| configuration | seed | accuracy (best) | uplink MB | down: current MB | catch-up MB | snapshot MB "
             "| total MB | total ratio | catch-up median (<=10 behind) |", "|---" * 10 + "|"]
    for r in results:
        total = r["uplink_bytes"] + r["downlink_bytes"]
        k = r["downlink_by_kind"]
        current = k["current"] if r["downlink"] != "none" else r["downlink_bytes"]
        median = r["catch_up_median_of_fp32_up_to_10"]
        lines.append(
            f"| {r['label']} | {r['seed']} | {100 * r['accuracy']:.2f}% ({100 * r['best_accuracy']:.2f}%) "
            f"| {r['uplink_bytes'] / 1e6:.3f} | {current / 1e6:.3f} | {k['catch_up'] / 1e6:.3f} | {k['snapshot'] / 1e6:.3f} "
            f"| {total / 1e6:.3f} | {base_total / total:.1f}x | {'-' if median is None else f'{median:.4f} of fp32'} |")
    return "\n".join(lines)


def seeds_table(results: list[dict]) -> tuple[str, list[dict]]:
    """Each configuration over its seeds: final accuracy's mean and 95% interval, and the paired
    difference against the first configuration (seed by seed), with its verdict."""
    labels = list(dict.fromkeys(r["label"] for r in results))
    by = {label: {r["seed"]: r["accuracy"] for r in results if r["label"] == label} for label in labels}
    seeds = sorted(set.intersection(*(set(v) for v in by.values())))
    base = [by[labels[0]][s] for s in seeds]
    rows, lines = [], [f"Final held-out accuracy over seeds {seeds} (95% interval, Student t; differences paired "
                       f"seed by seed against {labels[0]!r}):", "",
                       "| configuration | final accuracy | paired difference |", "|---|---|---|"]
    for label in labels:
        values = [by[label][s] for s in seeds]
        row = seeds_row(label, values, None if label == labels[0] else base)
        rows.append(row)
        diff = "-" if label == labels[0] else verdict(paired(values, base))
        lines.append(f"| {label} | {interval(values).text(scale=100, unit='%')} | {diff} |")
    return "\n".join(lines), rows


def typed_settings(items: list[str]) -> dict[str, object]:
    """``["server-opt=fedavg:lr=2", "lr=0.05"]`` as RunSettings keyword arguments, parsed and checked
    by the settings' own parser (an unknown key or a bad value is refused with its reason)."""
    pairs = dict(item.split("=", 1) for item in items if item)
    chosen = RunSettings.from_run_config(pairs)
    return {key.replace("-", "_"): getattr(chosen, key.replace("-", "_")) for key in pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--partitioning", default="dirichlet:alpha=0.5")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--config", action="append", metavar="LABEL;CODEC;DOWNLINK[;KEY=VALUE,...]",
                        help=f"a configuration (repeatable; default: {DEFAULT_CONFIGS}); an optional fourth "
                             "field sets other run settings for this configuration only, e.g. "
                             "'...;server-opt=fedavg:lr=2|update-norm=clip:factor=3' ('|' separates them)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                        help="any other run setting, e.g. --set lr=0.05")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="runs at once, each in its own processes at one thread (default: one per core); "
                             "a run's result does not depend on it")
    parser.add_argument("--out", default="bench/results/bidirectional")
    args = parser.parse_args(argv)
    extra = typed_settings(args.settings)  # refused here, before any run starts
    jobs = [(args, seed, config) for seed in args.seeds for config in (args.config or DEFAULT_CONFIGS)]
    results = map_runs(_job, jobs, args.workers)
    command = ".venv/bin/python " + shlex.join(sys.argv)
    seeds_text, seed_rows = seeds_table(results)
    text = "\n".join([
        f"# Both directions compressed ({time.strftime('%Y-%m-%d')}, {platform.node()}, {platform.processor() or platform.machine()})",
        "", f"    {command}", "",
        f"{args.clients} clients, {args.per_round} per round, {args.rounds} rounds, {args.local_epochs} local epochs, "
        f"task {args.task}, {args.partitioning}, settings {extra or 'default'}.", "", seeds_text, "", table(results), "",
        "Catch-up messages by versions behind (median size as a fraction of one fp32 model):", "",
        *[f"- {r['label']} seed {r['seed']}: " + ", ".join(
            f"{v}: {h['count']} x {h['median_of_fp32']:.4f}" for v, h in r["catch_up_histogram"].items())
          for r in results if r["catch_up_histogram"]],
    ])
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"command": command, "seeds": seed_rows, "results": results}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
