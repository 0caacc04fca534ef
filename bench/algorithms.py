"""Round algorithms side by side: FedAvg, EASGD and gossip on the same task, clients, rounds and seeds;
with ``--suite stragglers``, synchronous FedAvg against asynchronous FedBuff and FedAsync with slow clients.

Every run goes through Flower's simulation engine (``server.engines.launch``), exactly as ``fedge demo``
runs. Per configuration: final held-out accuracy of the run's model (FedAvg's global model, EASGD's
center, gossip's average model), the best and final accuracy, for gossip the consensus distance
and the worst node's accuracy, uplink bytes (real encoded payloads), downlink bytes, measurement
uploads (gossip's exact node models, not training traffic), bytes per node per round, wall time.
Writes a markdown table, JSON with the command line, and a PNG (accuracy and consensus distance
per round, and accuracy against wall time).

The straggler suite gives every configuration the same client work (30 FedAvg rounds of 16 updates
= 60 FedBuff versions of 8 = 480 FedAsync versions of 1), slows a quarter of the clients 5x
(``stragglers = "fraction=0.25,slowdown=5"``: each sleeps four times its real training time) and
reports the wall-clock time to the target accuracy, measured from the first message of the run.
On the simulation engine every client gets its own Ray actor (``parallel_clients``), so a slow client
sleeping through its slowdown does not take a CPU slot the others queue behind, as on real devices.

    .venv/bin/python bench/algorithms.py                      # 16 clients, 30 rounds, seed 42
    .venv/bin/python bench/algorithms.py --rounds 10 --only fedavg easgd   # a quick look
    .venv/bin/python bench/algorithms.py --suite stragglers   # FedAvg vs FedBuff vs FedAsync, time to 95%
    .venv/bin/python bench/algorithms.py --suite stragglers --engine deployment --clients 8 --rounds 15
    .venv/bin/python bench/algorithms.py --suite byzantine --clients 20   # robust aggregators under attack
    .venv/bin/python bench/algorithms.py --suite selection --seeds 1 2 3   # stragglers, 8 of 16 asked: uniform vs oort
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness.seeds import interval, paired, verdict  # noqa: E402
from fedge.server.local import launch  # noqa: E402
from fedge.server.settings import RunSettings, SettingsError  # noqa: E402

# (label, algorithm spec, codec); a spec may use {n} (clients) and {half} (clients // 2)
CONFIGS = [
    ("fedavg", "fedavg", "qsgd:bits=4"),
    ("easgd", "easgd", "qsgd:bits=4"),
    ("gossip-ring-fp32", "gossip:topology=ring", "none"),
    ("gossip-ring-q4", "gossip:topology=ring", "qsgd:bits=4"),
    ("gossip-exp-fp32", "gossip:topology=exponential", "none"),
    ("gossip-exp-q4", "gossip:topology=exponential", "qsgd:bits=4"),
    ("gossip-exp-sign", "gossip:topology=exponential,gamma=0.5", "sign:bucket=512"),
    ("gossip-onepeer-q4", "gossip:topology=onepeer", "qsgd:bits=4"),
]
STRAGGLER_CONFIGS = [
    ("fedavg", "fedavg", "qsgd:bits=4"),
    ("fedbuff", "fedbuff:concurrency={n},buffer={half}", "qsgd:bits=4"),
    ("fedasync", "fedasync:concurrency={n}", "qsgd:bits=4"),
]
# 20% of the clients send sign-flipped, 10x-scaled updates that decode cleanly (fault signflip)
_ATTACK = {"faulty_clients": "fraction=0.2,fault=signflip"}
BYZANTINE_CONFIGS = [
    ("clean-mean", "fedavg", "qsgd:bits=4", {}),
    ("attacked-mean", "fedavg", "qsgd:bits=4", _ATTACK),
    ("attacked-median", "fedavg", "qsgd:bits=4", {**_ATTACK, "aggregator": "median"}),
    ("clean-trimmed-mean", "fedavg", "qsgd:bits=4", {"aggregator": "trimmed-mean:beta=0.2"}),
    ("attacked-trimmed-mean", "fedavg", "qsgd:bits=4", {**_ATTACK, "aggregator": "trimmed-mean:beta=0.2"}),
    ("clean-krum", "fedavg", "qsgd:bits=4", {"aggregator": "krum:f={fifth}"}),
    ("attacked-krum", "fedavg", "qsgd:bits=4", {**_ATTACK, "aggregator": "krum:f={fifth}"}),
    ("attacked-multikrum", "fedavg", "qsgd:bits=4", {**_ATTACK, "aggregator": "multikrum:f={fifth},m={honest}"}),
    # the same rules after nearest-neighbour mixing (Allouah et al. 2023), the remedy for skewed data
    ("clean-trimmed-mean-nnm", "fedavg", "qsgd:bits=4", {"aggregator": "trimmed-mean:beta=0.2,nnm={fifth}"}),
    ("attacked-trimmed-mean-nnm", "fedavg", "qsgd:bits=4",
     {**_ATTACK, "aggregator": "trimmed-mean:beta=0.2,nnm={fifth}"}),
    ("clean-krum-nnm", "fedavg", "qsgd:bits=4", {"aggregator": "krum:f={fifth},nnm={fifth}"}),
    ("attacked-krum-nnm", "fedavg", "qsgd:bits=4", {**_ATTACK, "aggregator": "krum:f={fifth},nnm={fifth}"}),
    ("attacked-norm-reject", "fedavg", "qsgd:bits=4", {**_ATTACK, "update_norm": "reject:factor=3"}),
    ("attacked-norm-clip", "fedavg", "qsgd:bits=4", {**_ATTACK, "update_norm": "clip:factor=1"}),
]
# the straggler suite's devices, half of them asked per round: the engine's seeded sample against Oort's rule
SELECTION_CONFIGS = [
    ("uniform", "fedavg", "qsgd:bits=4", {"selection": "uniform", "clients_per_round": "{half}"}),
    ("oort", "fedavg", "qsgd:bits=4", {"selection": "oort", "clients_per_round": "{half}"}),
]
SUITES = {"algorithms": CONFIGS, "stragglers": STRAGGLER_CONFIGS, "byzantine": BYZANTINE_CONFIGS,
          "selection": SELECTION_CONFIGS}


def versions_per_round(algorithm: str, clients: int) -> int:
    """Model versions an algorithm publishes for one synchronous round's worth of client updates."""
    from fedge.compression.spec import parse_spec

    name, params = parse_spec(algorithm)
    if name == "fedbuff":
        return max(1, clients // int(params.get("buffer", max(1, clients // 2))))
    return clients if name == "fedasync" else 1


def time_to(target: float, accuracy: list[float], wall: list[float | None]) -> float | None:
    """Wall seconds until the run's model first reached ``target`` held-out accuracy (None: never)."""
    return next((w for a, w in zip(accuracy, wall) if a >= target and w is not None), None)


def run_one(label: str, algorithm: str, codec: str, args: argparse.Namespace, seed: int, root: Path,
            own: dict | None = None) -> dict:
    """One configuration; ``own`` settings (this configuration's) win over ``--set`` ones."""
    n = args.clients
    fifth = math.ceil(0.2 * n)
    names = {"n": n, "half": max(1, n // 2), "fifth": fifth, "honest": n - fifth}
    algorithm = algorithm.format(**names)
    own = {key: str(value).format(**names) for key, value in (own or {}).items()}
    typed = RunSettings.from_run_config({key.replace("_", "-"): value for key, value in own.items()})
    own = {key: getattr(typed, key) for key in own}  # "8" -> 8, as --set values are typed
    per_round = int(args.overrides.get("clients_per_round", n))  # --set clients-per-round=K: partial participation
    rounds = args.rounds * versions_per_round(algorithm, per_round)
    settings = RunSettings(**{
        "algorithm": algorithm, "codec": codec, "rounds": rounds, "clients_per_round": n,
        "local_epochs": args.local_epochs, "partitioning": args.partitioning, "seed": seed,
        "run_dir": str(root / f"{label}-{seed}"), **args.overrides, **own,
    })
    stragglers = settings.stragglers != "none"
    started = time.monotonic()
    result = launch(settings, engine=args.engine, num_supernodes=n, timeout=3 * 3600,
                    parallel_clients=n if stragglers and args.engine == "simulation" else 0)
    wall = time.monotonic() - started
    rows, summary = result.rows, result.summary or {}
    accuracy = [r["accuracy"] for r in rows]
    elapsed = [r.get("wall_seconds") for r in rows]
    return {
        "label": label, "algorithm": algorithm, "codec": codec, "seed": seed, "engine": args.engine,
        "settings": own,
        "rejected_updates": sum(len([x for x in r["rejected"] if x.get("node") is not None]) for r in rows),
        "clipped_updates": sum(len(r.get("clipped_nodes") or []) for r in rows),
        "versions": len(rows), "client_updates": sum(r["clients_used"] for r in rows),
        "elapsed": elapsed, "time_to_target": time_to(args.target, accuracy, elapsed), "target": args.target,
        "staleness_mean": _mean([r.get("staleness_mean") for r in rows]),
        "staleness_max": max((r.get("staleness_max") or 0 for r in rows), default=0),
        "dropped_stale": sum(r.get("dropped_stale", 0) for r in rows),
        "final_accuracy": summary.get("final_accuracy"),
        "best_accuracy": max(r["accuracy"] for r in rows),
        "accuracy": [r["accuracy"] for r in rows],
        # uplink + downlink bytes sent up to each row (real encoded payloads and models), for accuracy vs traffic
        "total_bytes": list(itertools.accumulate(r["uplink_bytes"] + r["downlink_bytes"] for r in rows)),
        "consensus_distance": [r.get("consensus_distance") for r in rows],
        "node_accuracy_worst": rows[-1].get("node_accuracy_worst"),
        "node_accuracy_mean": rows[-1].get("node_accuracy_mean") or rows[-1].get("client_model_accuracy"),
        "uplink_bytes": sum(r["uplink_bytes"] for r in rows),
        "uplink_fp32_bytes": sum(r["uplink_fp32_bytes"] for r in rows),
        "downlink_bytes": sum(r["downlink_bytes"] for r in rows),
        "measurement_bytes": sum(r.get("measurement_bytes", 0) for r in rows),
        "bytes_per_node_round": (sum(r["uplink_bytes"] + r["downlink_bytes"] for r in rows)) / (n * len(rows)),
        "round_seconds": sum(r["seconds"] for r in rows) / len(rows),
        "participation": rows[-1].get("participation") if rows else None,
        "wall_seconds": wall,
    }


def seeds_summary(results: list[dict], seeds: list[int]) -> str:
    """Over the seeds, per configuration: final accuracy with its 95% interval and its difference from
    the first configuration's, paired by seed; where every run reached the target, the time to it
    and the speed-up against the first configuration (a ratio per seed, then its interval).
    Asynchronous runs differ from run to run even for one seed: their interval is that spread too."""
    labels = list(dict.fromkeys(r["label"] for r in results))
    by = {(r["label"], r["seed"]): r for r in results}
    lines = [f"Over seeds {seeds} (95% interval, Student t; differences and speed-ups paired by seed against "
             f"{labels[0]}):", ""]
    base = [by[(labels[0], s)] for s in seeds]
    for label in labels:
        runs = [by[(label, s)] for s in seeds]
        accuracy = [r["final_accuracy"] for r in runs]
        line = f"- {label}: final accuracy {interval(accuracy).text(scale=100, unit='%')}"
        if label != labels[0]:
            line += f"; {verdict(paired(accuracy, [r['final_accuracy'] for r in base]))}"
        times = [r["time_to_target"] for r in runs]
        if all(t is not None for t in times):
            line += f"; time to {100 * runs[0]['target']:.0f}% {interval(times).text(digits=0, unit=' s')}"
            base_times = [r["time_to_target"] for r in base]
            if label != labels[0] and all(t is not None for t in base_times):
                speedups = [b / t for b, t in zip(base_times, times, strict=True)]
                line += f", speed-up {interval(speedups).text(unit='x')}"
        lines.append(line)
    return "\n".join(lines)


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def table(results: list[dict]) -> str:
    lines = [
        "| run | algorithm | codec | final acc | best acc | worst node | consensus dist (last) | uplink MB | "
        "downlink MB | B/node/round (up+down) | s/round | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        xi = r["consensus_distance"][-1]
        worst = r["node_accuracy_worst"]
        lines.append(
            f"| {r['label']} | `{r['algorithm']}` | `{r['codec']}` | {100 * r['final_accuracy']:.2f}% | "
            f"{100 * r['best_accuracy']:.2f}% | {'-' if worst is None else f'{100 * worst:.2f}%'} | "
            f"{'-' if xi is None else f'{xi:.3g}'} | {r['uplink_bytes'] / 1e6:.3f} | {r['downlink_bytes'] / 1e6:.3f} | "
            f"{r['bytes_per_node_round']:,.0f} | {r['round_seconds']:.2f} | {r['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)


def straggler_table(results: list[dict]) -> str:
    """Time to the target accuracy, with the ratio to synchronous FedAvg of the same seed."""
    baseline = {r["seed"]: r["time_to_target"] for r in results if r["label"] == "fedavg"}
    target = results[0]["target"] if results else 0.95
    lines = [
        f"| run | algorithm | versions | client updates | final acc | best acc | time to {100 * target:g}% | "
        "speed-up vs FedAvg | staleness mean / max | dropped stale | wall s (whole run) | uplink MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t, base = r["time_to_target"], baseline.get(r["seed"])
        ratio = f"{base / t:.2f}x" if t and base else "-"
        stale = "-" if r["staleness_mean"] is None else f"{r['staleness_mean']:.2f} / {r['staleness_max']}"
        lines.append(
            f"| {r['label']} | `{r['algorithm']}` | {r['versions']} | {r['client_updates']} | "
            f"{100 * r['final_accuracy']:.2f}% | {100 * r['best_accuracy']:.2f}% | "
            f"{'not reached' if t is None else f'{t:.0f} s'} | {ratio} | {stale} | {r['dropped_stale']} | "
            f"{r['wall_seconds']:.0f} | {r['uplink_bytes'] / 1e6:.3f} |"
        )
    return "\n".join(lines)


def selection_table(results: list[dict]) -> str:
    """Time to the target accuracy with each selection rule, the ratio to ``uniform`` of the same seed,
    and the fairness figure: Jain's index over every device's selection count, with its min and max."""
    baseline = {r["seed"]: r["time_to_target"] for r in results if r["label"] == "uniform"}
    target = results[0]["target"] if results else 0.95
    lines = [
        f"| run | seed | final acc | best acc | time to {100 * target:g}% | speed-up vs uniform | "
        "Jain's index | selections min / max | s/round | wall s (whole run) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t, base = r["time_to_target"], baseline.get(r["seed"])
        ratio = f"{base / t:.2f}x" if t and base else "-"
        share = r.get("participation") or {}
        lines.append(
            f"| {r['label']} | {r['seed']} | {100 * r['final_accuracy']:.2f}% | {100 * r['best_accuracy']:.2f}% | "
            f"{'not reached' if t is None else f'{t:.0f} s'} | {ratio} | {share.get('jain', '-')} | "
            f"{share.get('min', '-')} / {share.get('max', '-')} | {r['round_seconds']:.2f} | {r['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)


def byzantine_table(results: list[dict]) -> str:
    """Accuracy under attack, against the clean FedAvg run of the same seed and, when it was run, against
    the same defence without attackers (``clean-<rule>`` next to ``attacked-<rule>``): the first says
    what attack and defence cost together, the second what the attack costs a defended run."""
    clean = {r["seed"]: r["final_accuracy"] for r in results if r["label"] == "clean-mean"}
    same = {(r["seed"], r["label"][len("clean-"):]): r["final_accuracy"] for r in results
            if r["label"].startswith("clean-")}
    lines = [
        "| run | defence | final acc | best acc | vs clean mean | vs same defence, clean | updates rejected "
        "| updates clipped | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = clean.get(r["seed"])
        own = same.get((r["seed"], r["label"][len("attacked-"):])) if r["label"].startswith("attacked-") else None
        defence = ", ".join(f"{k.replace('_', '-')}={v}" for k, v in r["settings"].items()
                            if k != "faulty_clients") or "none (weighted mean)"
        attackers = "faulty_clients" in r["settings"]
        delta = "-" if base is None or r["label"] == "clean-mean" else f"{100 * (r['final_accuracy'] - base):+.2f}"
        versus = "-" if own is None or not attackers else f"{100 * (r['final_accuracy'] - own):+.2f}"
        lines.append(
            f"| {r['label']} | `{defence}` | {100 * r['final_accuracy']:.2f}% | {100 * r['best_accuracy']:.2f}% | "
            f"{delta} | {versus} | {r['rejected_updates']} | {r['clipped_updates']} | {r['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gossip = any(x is not None for r in results for x in r["consensus_distance"])
    fig, axes = plt.subplots(1, 4 if gossip else 3, figsize=(21 if gossip else 16, 4), dpi=120)
    left, traffic, timed = axes[0], axes[-2], axes[-1]
    right = axes[1] if gossip else None
    for r in results:
        traffic.semilogx([b / 1e6 for b in r["total_bytes"]], [100 * a for a in r["accuracy"]], label=r["label"])
    traffic.set(xlabel="total MB sent (uplink + downlink)", ylabel="held-out accuracy (%)",
                title="accuracy against traffic", ylim=(0, 100))
    traffic.grid(alpha=0.3)
    for r in results:
        wall = [(w, 100 * a) for w, a in zip(r["elapsed"], r["accuracy"]) if w is not None]
        if wall:
            timed.plot([w for w, _ in wall], [a for _, a in wall], label=f"{r['label']} (seed {r['seed']})")
        rounds = range(1, len(r["accuracy"]) + 1)
        left.plot(rounds, [100 * a for a in r["accuracy"]], label=r["label"])
        xi = [(i, x) for i, x in zip(rounds, r["consensus_distance"]) if x is not None]
        if xi and right is not None:
            right.semilogy([i for i, _ in xi], [max(x, 1e-12) for _, x in xi], label=r["label"])
    left.set(xlabel="round (asynchronous runs: model version)", ylabel="held-out accuracy (%)",
             title="accuracy of the run's model", ylim=(0, 100))
    timed.set(xlabel="wall seconds since the first message", ylabel="held-out accuracy (%)",
              title="accuracy against wall time", ylim=(0, 100))
    timed.grid(alpha=0.3)
    timed.legend(fontsize=7)
    if right is not None:
        right.set(xlabel="round", ylabel="consensus distance (1/n) sum |x_i - x_bar|^2", title="gossip consensus")
        right.grid(alpha=0.3)
        right.legend(fontsize=7)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    # SIGTERM unwinds like Ctrl-C, so launch() stops every Flower process it started.
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--partitioning", default="dirichlet:alpha=0.5")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--suite", choices=sorted(SUITES), default="algorithms",
                        help="algorithms: FedAvg/EASGD/gossip; stragglers: FedAvg/FedBuff/FedAsync with slow clients "
                        "(sets stragglers=fraction=0.25,slowdown=5 unless --set gives it); byzantine: 20%% of the "
                        "clients send sign-flipped 10x updates, against each aggregator and the norm bound; selection: "
                        "the stragglers' devices, half asked per round, selection=uniform against oort")
    parser.add_argument("--engine", choices=("simulation", "deployment"), default="simulation")
    parser.add_argument("--target", type=float, default=0.95, help="accuracy for the time-to-target column")
    parser.add_argument("--only", nargs="*", help="labels of the built-in configurations to run (default: all; "
                        "give none to run only --config ones)")
    parser.add_argument("--config", action="append", default=[], metavar="LABEL;ALGORITHM;CODEC",
                        help="an extra configuration, e.g. 'easgd-a0.5;easgd:alpha=0.5;qsgd:bits=4' (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                        help="a run setting for every configuration, e.g. 'momentum=0.9' (repeatable; "
                        "see `fedge settings`)")
    parser.add_argument("--out", help="output path without suffix (default: bench/results/algorithms, "
                        "or algorithms-stragglers for that suite)")
    args = parser.parse_args()
    if args.suite in ("stragglers", "selection") and not any(item.startswith("stragglers=") for item in args.settings):
        args.settings.append("stragglers=fraction=0.25,slowdown=5")
    extra = [tuple(c.split(";")) for c in args.config]
    if any(len(c) != 3 for c in extra):
        parser.error("--config takes LABEL;ALGORITHM;CODEC")
    pairs = dict(item.split("=", 1) for item in args.settings if "=" in item)
    if len(pairs) != len(args.settings):
        parser.error("--set takes KEY=VALUE")
    try:
        chosen = RunSettings.from_run_config(pairs)
    except SettingsError as exc:
        parser.error(str(exc))
    args.overrides = {key.replace("-", "_"): getattr(chosen, key.replace("-", "_")) for key in pairs}
    configs = [c for c in SUITES[args.suite] if args.only is None or c[0] in args.only] + extra
    show = {"stragglers": straggler_table, "byzantine": byzantine_table, "selection": selection_table}.get(
        args.suite, table)
    results = []
    with tempfile.TemporaryDirectory(prefix="fedge-bench-algorithms-") as tmp:
        for seed in args.seeds:
            for label, algorithm, codec, *own in configs:
                print(f"== {label} (seed {seed})", flush=True)
                results.append(run_one(label, algorithm, codec, args, seed, Path(tmp), *own))
                print(show(results[-1:]).splitlines()[-1], flush=True)
    default = "algorithms" if args.suite == "algorithms" else f"algorithms-{args.suite}"
    out = Path(args.out or Path(__file__).parent / "results" / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join([".venv/bin/python", "bench/algorithms.py", *sys.argv[1:]])  # quoted: --config has ";"
    header = (f"Measured {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()} "
              f"({platform.platform()}); {pairs.get('task', 'digits')}, {args.clients} clients, {args.partitioning}, {args.rounds} rounds "
              f"of {args.local_epochs} local epochs, seeds {args.seeds}, {args.engine} engine"
              f"{''.join(f', {item}' for item in args.settings)}; `{command}`")
    markdown = header + "\n\n" + show(results) + "\n"
    if len(args.seeds) > 1:
        markdown += "\n" + seeds_summary(results, args.seeds) + "\n"
    out.with_suffix(".md").write_text(markdown)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "results": results}, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(markdown)
    print(f"wrote {out}.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
