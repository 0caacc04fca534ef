"""Secure aggregation with distributed DP (Skellam noise added by the devices inside the ring)
against central DP (Gaussian noise added by the coordinator), at the same epsilon, side by side.

For each target epsilon and seed: one run with central DP and one with secure aggregation plus
distributed DP, on Flower's simulation engine, same task, clients, Poisson rate and rounds. Each
mode's noise multiplier is the smallest one whose *reported* epsilon after ``--rounds`` rounds at
the expected sample is at most the target (central: dp-accounting's PLD; distributed: the Skellam
RDP ledger at the round's fixed noise V, with Zhu and Wang's general amplification bound, so it
needs more noise for the same epsilon). Distributed rows also report the worst device's epsilon
against the coordinator, which knows who took part (no amplification).
Bytes per coordinate are the masked uploads' real bytes (header included) over the
coordinates sent, against the ring the plan sized (b + ceil(log2 n) + noise headroom).

    .venv/bin/python bench/distributed_dp.py --task digits --clients 100 --per-round 10 --rounds 30
    .venv/bin/python bench/distributed_dp.py --task fashion --clients 100 --per-round 10 --rounds 30

``--device-policy`` runs the distributed mode's devices under a privacy policy (the run setting
``device-policy``, which stands for each device's node config in a simulation; ``{noise}`` and
``{clip}`` are the run's own noise multiplier and clip), for example
``require-secure-aggregation,min-participants=5,dp-min-noise={noise},dp-max-clip={clip}``: a round
planned below the floor is refused by its devices, releases noise alone and is still charged.
Central DP runs without it (a device that requires secure aggregation refuses central DP's rounds).
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

from fedge.privacy.accountant import PrivacyLedger, SkellamLedger
from fedge.privacy.dp_spec import parse_differential_privacy
from fedge.privacy.distributed_dp import ledger_round
from fedge.server.local import launch
from fedge.server.run.initial_model import initial_params
from fedge.server.settings import RunSettings
from fedge.tasks import make_task


def smallest_noise(epsilon_at, target: float) -> float:
    """The smallest z in [0.1, 50] with epsilon_at(z) <= target (epsilon falls as z grows)."""
    low, high = 0.1, 50.0
    for _ in range(40):
        mid = (low + high) / 2
        if epsilon_at(mid) <= target:
            high = mid
        else:
            low = mid
    return high


def central_noise(target: float, q: float, rounds: int, delta: float) -> float:
    return smallest_noise(lambda z: PrivacyLedger(delta, [(q, z)] * rounds).epsilon_pld(), target)


def distributed_noise_multiplier(target: float, q: float, rounds: int, delta: float, clip: float,
                                 numel: int) -> float:
    # every round that releases a sum carries the same noise, Sk(V), whoever took part (the devices'
    # shares plus the coordinator's top-up for those that dropped): the ledger records V each round
    def epsilon(z: float) -> float:
        spec = parse_differential_privacy(f"gaussian:noise={z},clip={clip}")
        return SkellamLedger(delta, [ledger_round(spec, numel, q)] * rounds).epsilon()
    return smallest_noise(epsilon, target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epsilon", type=float, nargs="+", default=[8.0, 4.0])
    parser.add_argument("--partitioning", default="iid",
                        help="iid by default: digits has too few examples for 100 Dirichlet partitions")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--central-only-at", type=float, default=None, metavar="Z",
                        help="explanatory: run central DP alone at noise multiplier Z (its epsilon is then "
                             "whatever Z gives), e.g. at distributed DP's effective noise")
    parser.add_argument("--codec", default=None,
                        help="the devices' uplink codec under central DP (default: the run setting's); "
                             "secure aggregation sends the ring whatever it is")
    parser.add_argument("--model-average", default="none",
                        help="e.g. ema:decay=0.8: the measured model is an average of the released ones "
                             "(post-processing, free under DP), the same for both modes")
    parser.add_argument("--device-policy", default="none",
                        help="the distributed mode's device policy ({noise}, {clip}: the run's), e.g. "
                             "'require-secure-aggregation,min-participants=5,dp-min-noise={noise},dp-max-clip={clip}'")
    parser.add_argument("--out", type=Path, default=Path("bench/results/distributed-dp.json"))
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "bench/distributed_dp.py", *(argv or sys.argv[1:])])
    q = args.per_round / args.clients
    numel = int(initial_params(make_task(args.task), 0).numel())
    results = []
    for target in args.epsilon:
        z_central = central_noise(target, q, args.rounds, args.delta)
        z_distributed = distributed_noise_multiplier(target, q, args.rounds, args.delta, args.clip, numel)
        for seed in args.seeds:
            modes = (("central", z_central), ("secagg+distributed", z_distributed))
            if args.central_only_at is not None:
                modes = (("central", args.central_only_at),)
            for mode, z in modes:
                dp = f"gaussian:noise={z:.4f},clip={args.clip:g},delta={args.delta:g}"
                secure = "secagg:bits=8,clip=0.2,weight-cap=256" if mode != "central" else "none"
                policy = (args.device_policy.format(noise=f"{z:.4f}", clip=f"{args.clip:g}")
                          if mode != "central" else "none")
                with tempfile.TemporaryDirectory() as tmp:
                    settings = RunSettings(task=args.task, rounds=args.rounds, clients_per_round=args.per_round,
                                           local_epochs=args.local_epochs, lr=args.lr, seed=seed,
                                           partitioning=args.partitioning,
                                           differential_privacy=dp, secure_aggregation=secure,
                                           model_average=args.model_average, device_policy=policy,
                                           **({"codec": args.codec} if args.codec else {}),
                                           run_dir=str(Path(tmp) / "run"))
                    started = time.perf_counter()
                    rows = launch(settings, engine="simulation", num_supernodes=args.clients, timeout=7200).rows
                if sum(r["clients_used"] for r in rows) < len(rows):  # DP noise alone would still "train"
                    raise SystemExit(f"{mode}: almost no device update was used ({rows[-1]['rejected'][:1]})")
                masked = [r["uplink_bytes"] / (r["clients_used"] * numel) for r in rows
                          if mode != "central" and r["clients_used"]]
                results.append({
                    "target_epsilon": target, "mode": mode, "seed": seed, "noise_multiplier": z,
                    "epsilon": rows[-1].get("dp_epsilon"),
                    # distributed only: the worst device's epsilon against the coordinator, which
                    # knows who took part (no amplification), and its number of rounds
                    "epsilon_against_coordinator": rows[-1].get("dp_epsilon_coordinator"),
                    "most_rounds_of_a_device": rows[-1].get("dp_coordinator_rounds"),
                    "final_accuracy": rows[-1]["accuracy"],
                    "best_accuracy": max(r["accuracy"] for r in rows), "rounds": len(rows),
                    # DP's noise moves the model every round: the last five rounds' mean is steadier
                    "last5_accuracy": statistics.mean(r["accuracy"] for r in rows[-5:]),
                    "ring_bits": (f"{min(bits)}-{max(bits)}" if (bits := [r["secagg_ring_bits"] for r in rows
                                                                         if "secagg_ring_bits" in r]) else None),
                    # a round whose secure round could not start (fewer than two devices sampled) or
                    # whose sum could not be unmasked: it released noise alone
                    "rounds_without_a_sum": sum(1 for r in rows if not r["clients_used"]),
                    "device_policy": policy,
                    # rounds whose devices refused the plan under their policy (typed "policy")
                    "rounds_refused_by_policy": sum(1 for r in rows if (r.get("failures") or {}).get("policy")),
                    "bytes_per_coordinate": statistics.mean(masked) if masked else None,
                    "wall_seconds": time.perf_counter() - started,
                })
                print(results[-1], flush=True)
    print(f"\n{args.task}, {args.clients} clients, Poisson q = {q:g}, {args.rounds} rounds, clip {args.clip:g}, "
          f"model average {args.model_average}, "
          f"delta {args.delta:g}, seeds {args.seeds}")
    print("| target ε | mode | noise z | ε reported | ε against the coordinator, worst device (its rounds) | "
          "final accuracy (per seed) | mean | last 5 rounds' mean | ring bits | bytes / coordinate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for target in args.epsilon:
        for mode in ("central", "secagg+distributed"):
            runs = [r for r in results if r["target_epsilon"] == target and r["mode"] == mode]
            if not runs:
                continue
            accs = ", ".join(f"{r['final_accuracy']:.1%}" for r in runs)
            mean = statistics.mean(r["final_accuracy"] for r in runs)
            bits = runs[0]["ring_bits"] or "-"
            per = f"{statistics.mean(r['bytes_per_coordinate'] for r in runs):.3f}" if runs[0]["bytes_per_coordinate"] else "-"
            worst = ", ".join(f"{r['epsilon_against_coordinator']:.1f} ({r['most_rounds_of_a_device']})" for r in runs
                              if r["epsilon_against_coordinator"] is not None) or "all (central DP trusts it)"
            print(f"| {target:g} | {mode} | {runs[0]['noise_multiplier']:.3f} | {runs[0]['epsilon']:.2f} | {worst} | "
                  f"{accs} | {mean:.1%} | {statistics.mean(r['last5_accuracy'] for r in runs):.1%} | {bits} | {per} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d %H:%M"),
                                    "machine": platform.platform(), "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}; reproduce: {command}")


if __name__ == "__main__":
    main()
