"""Accuracy against epsilon: client-level DP-FedAvg at several noise levels, side by side.

For each noise multiplier z (and a run without DP), one Flower simulation run with the same task,
clients, sampling rate and rounds; each run reports its final and best held-out accuracy and the
epsilon it spent (PLD, and RDP for comparison) at ``--delta``. Poisson sampling at rate
clients-per-round / clients; updates clipped to L2 norm ``--clip``.

    .venv/bin/python bench/differential_privacy.py --task digits --clients 50 --per-round 10 --rounds 30
    .venv/bin/python bench/differential_privacy.py --task fashion --clients 100 --per-round 20 --rounds 30
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from fedge.server.local import launch
from fedge.server.settings import RunSettings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--codec", default="none")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=Path("bench/results/differential-privacy.json"))
    args = parser.parse_args(argv)
    command = " ".join([".venv/bin/python", "bench/differential_privacy.py", *(argv or sys.argv[1:])])
    results = []
    for z in [0.0, *args.noise]:
        dp = "none" if z == 0 else f"gaussian:noise={z:g},clip={args.clip:g},delta={args.delta:g}"
        with tempfile.TemporaryDirectory() as tmp:
            settings = RunSettings(task=args.task, rounds=args.rounds, clients_per_round=args.per_round,
                                   local_epochs=args.local_epochs, lr=args.lr, codec=args.codec, seed=args.seed,
                                   differential_privacy=dp, run_dir=str(Path(tmp) / "run"))
            started = time.perf_counter()
            result = launch(settings, engine="simulation", num_supernodes=args.clients, timeout=7200)
            rows = result.rows
            last = rows[-1]
            results.append({
                "noise_multiplier": z, "final_accuracy": last["accuracy"], "best_accuracy": max(r["accuracy"] for r in rows),
                "epsilon_pld": last.get("dp_epsilon"), "epsilon_rdp": last.get("dp_epsilon_rdp"),
                "rounds": len(rows), "mean_clients": sum(r["clients_used"] for r in rows) / len(rows),
                "wall_seconds": time.perf_counter() - started,
            })
        print(results[-1], flush=True)
    print(f"\n{args.task}, {args.clients} clients, q = {args.per_round / args.clients:g} (Poisson), {args.rounds} rounds, "
          f"clip {args.clip:g}, delta {args.delta:g}, seed {args.seed}")
    print("| noise z | epsilon (PLD) | epsilon (RDP) | final accuracy | best |")
    print("|---|---|---|---|---|")
    for r in results:
        eps = f"{r['epsilon_pld']:.2f}" if r["epsilon_pld"] is not None else "∞ (no DP)"
        rdp = f"{r['epsilon_rdp']:.2f}" if r["epsilon_rdp"] is not None else "-"
        print(f"| {r['noise_multiplier']:g} | {eps} | {rdp} | {r['final_accuracy']:.2%} | {r['best_accuracy']:.2%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d %H:%M"),
                                    "machine": platform.platform(), "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}; reproduce: {command}")


if __name__ == "__main__":
    main()
