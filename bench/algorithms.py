"""Round algorithms side by side: FedAvg, EASGD and gossip on the same task, clients, rounds and seeds.

Every run goes through Flower's simulation engine (``server.engines.launch``), exactly as ``fedge demo``
runs. Per configuration: final held-out accuracy of the run's model (FedAvg's global model, EASGD's
center, gossip's average model), the best and final accuracy, for gossip the consensus distance
and the worst node's accuracy, uplink bytes (real encoded payloads), downlink bytes, measurement
uploads (gossip's exact node models, not training traffic), bytes per node per round, wall time.
Writes a markdown table, JSON with the command line, and a PNG (accuracy and consensus distance
per round).

    .venv/bin/python bench/algorithms.py                      # 16 clients, 30 rounds, seed 42
    .venv/bin/python bench/algorithms.py --rounds 10 --only fedavg easgd   # a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.engines import launch
from server.settings import RunSettings

# (label, algorithm spec, codec)
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


def run_one(label: str, algorithm: str, codec: str, args: argparse.Namespace, seed: int, root: Path) -> dict:
    settings = RunSettings(
        algorithm=algorithm, codec=codec, rounds=args.rounds, clients_per_round=args.clients,
        local_epochs=args.local_epochs, partitioning=args.partitioning, seed=seed,
        run_dir=str(root / f"{label}-{seed}"),
    )
    started = time.monotonic()
    result = launch(settings, engine="simulation", num_supernodes=args.clients, timeout=3600)
    wall = time.monotonic() - started
    rows, summary = result.rows, result.summary or {}
    n = args.clients
    return {
        "label": label, "algorithm": algorithm, "codec": codec, "seed": seed,
        "final_accuracy": summary.get("final_accuracy"),
        "best_accuracy": max(r["accuracy"] for r in rows),
        "accuracy": [r["accuracy"] for r in rows],
        "consensus_distance": [r.get("consensus_distance") for r in rows],
        "node_accuracy_worst": rows[-1].get("node_accuracy_worst"),
        "node_accuracy_mean": rows[-1].get("node_accuracy_mean") or rows[-1].get("client_model_accuracy"),
        "uplink_bytes": sum(r["uplink_bytes"] for r in rows),
        "uplink_fp32_bytes": sum(r["uplink_fp32_bytes"] for r in rows),
        "downlink_bytes": sum(r["downlink_bytes"] for r in rows),
        "measurement_bytes": sum(r.get("measurement_bytes", 0) for r in rows),
        "bytes_per_node_round": (sum(r["uplink_bytes"] + r["downlink_bytes"] for r in rows)) / (n * len(rows)),
        "round_seconds": sum(r["seconds"] for r in rows) / len(rows),
        "wall_seconds": wall,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| run | algorithm | codec | final acc | best acc | worst node | consensus dist (last) | uplink MB | "
        "downlink MB | B/node/round (up+down) | s/round |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        xi = r["consensus_distance"][-1]
        worst = r["node_accuracy_worst"]
        lines.append(
            f"| {r['label']} | `{r['algorithm']}` | `{r['codec']}` | {100 * r['final_accuracy']:.2f}% | "
            f"{100 * r['best_accuracy']:.2f}% | {'-' if worst is None else f'{100 * worst:.2f}%'} | "
            f"{'-' if xi is None else f'{xi:.3g}'} | {r['uplink_bytes'] / 1e6:.3f} | {r['downlink_bytes'] / 1e6:.3f} | "
            f"{r['bytes_per_node_round']:,.0f} | {r['round_seconds']:.2f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for r in results:
        rounds = range(1, len(r["accuracy"]) + 1)
        left.plot(rounds, [100 * a for a in r["accuracy"]], label=r["label"])
        xi = [(i, x) for i, x in zip(rounds, r["consensus_distance"]) if x is not None]
        if xi:
            right.semilogy([i for i, _ in xi], [max(x, 1e-12) for _, x in xi], label=r["label"])
    left.set(xlabel="round", ylabel="held-out accuracy (%)", title="accuracy of the run's model", ylim=(0, 100))
    right.set(xlabel="round", ylabel="consensus distance (1/n) sum |x_i - x_bar|^2", title="gossip consensus")
    left.grid(alpha=0.3)
    right.grid(alpha=0.3)
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--partitioning", default="dirichlet:alpha=0.5")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--only", nargs="*", help="labels of the built-in configurations to run (default: all; "
                        "give none to run only --config ones)")
    parser.add_argument("--config", action="append", default=[], metavar="LABEL;ALGORITHM;CODEC",
                        help="an extra configuration, e.g. 'easgd-a0.5;easgd:alpha=0.5;qsgd:bits=4' (repeatable)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "algorithms"))
    args = parser.parse_args()
    extra = [tuple(c.split(";")) for c in args.config]
    if any(len(c) != 3 for c in extra):
        parser.error("--config takes LABEL;ALGORITHM;CODEC")
    configs = [c for c in CONFIGS if args.only is None or c[0] in args.only] + extra
    results = []
    with tempfile.TemporaryDirectory(prefix="fedge-bench-algorithms-") as tmp:
        for seed in args.seeds:
            for label, algorithm, codec in configs:
                print(f"== {label} (seed {seed})", flush=True)
                results.append(run_one(label, algorithm, codec, args, seed, Path(tmp)))
                print(table(results[-1:]).splitlines()[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python", "bench/algorithms.py", *sys.argv[1:]])
    header = (f"Measured {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()} "
              f"({platform.platform()}); digits, {args.clients} clients, {args.partitioning}, {args.rounds} rounds "
              f"of {args.local_epochs} local epochs, seeds {args.seeds}; `{command}`")
    markdown = header + "\n\n" + table(results) + "\n"
    out.with_suffix(".md").write_text(markdown)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "results": results}, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(markdown)
    print(f"wrote {out}.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
