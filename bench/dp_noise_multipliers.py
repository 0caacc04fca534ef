"""Where distributed DP's larger noise multiplier comes from: the z each accounting needs for the
same epsilon, side by side (pure computation, a few seconds).

For a target epsilon, Poisson rate q, rounds and delta, the smallest z whose epsilon is within the
target, under:

1. central DP as reported: dp-accounting's PLD for the Poisson-sampled Gaussian;
2. central DP by RDP: dp-accounting's exact RDP of the sampled Gaussian (what budgeting uses);
3. the Gaussian's RDP through Zhu and Wang's general amplification bound (what any mechanism
   without an exact sampled analysis gets);
4. distributed DP as the ledger accounts it now: the Skellam mechanism at the round's fixed noise
   V = (z D2)^2, amplified as a symmetric mechanism (the remove direction's exact expansion, which
   bounds the add direction too: docs/privacy.md);
5. the same noise through the general bound (the ledger of 2026-11-26 09:40-10:45);
6. distributed DP as it was accounted until 2026-11-26 09:40: each round crediting the other
   survivors' noise, (k - 1) V / (m - 1) for a Poisson-drawn k and shares sized for the expected
   m = qN, through the general bound.

    .venv/bin/python bench/dp_noise_multipliers.py --epsilon 8 --q 0.1 --rounds 30 --numel 9098
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scipy import stats

from fedge.privacy.accountant import PrivacyLedger, SkellamLedger
from fedge.privacy.distributed_dp import (
    ORDERS,
    epsilon_from_rdp,
    ledger_round,
    skellam_rdp,
    subsampled_rdp,
)
from fedge.privacy.dp_spec import parse_differential_privacy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.distributed_dp import smallest_noise  # noqa: E402  (the calibration the comparison uses)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--q", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--numel", type=int, default=9098, help="model coordinates (fashion:model=small)")
    parser.add_argument("--clients", type=int, default=100, help="for the old rule's Poisson-drawn counts")
    args = parser.parse_args(argv)
    q, rounds, delta = args.q, args.rounds, args.delta

    def skellam_round(z: float) -> tuple[float, float, float, float]:
        return ledger_round(parse_differential_privacy(f"gaussian:noise={z},clip=1"), args.numel, q)

    expected = q * args.clients
    counts = [max(int(stats.binom.ppf((i + 0.5) / rounds, args.clients, q)), 1) for i in range(rounds)]

    def general(rounds_: list[tuple[float, float, float, float]]) -> float:
        total = [sum(subsampled_rdp(a, q_, lambda j, v=v, l1=l1, l2=l2: skellam_rdp(j, l1, l2, v))
                     for q_, v, l1, l2 in rounds_) for a in ORDERS]
        return epsilon_from_rdp(total, delta)

    def old_rule(z: float) -> float:
        _, variance, l1, l2 = skellam_round(z)
        return general([(q, (k - 1) * variance / (expected - 1), l1, l2) for k in counts])

    rows = [
        ("central DP, PLD (reported)", lambda z: PrivacyLedger(delta, [(q, z)] * rounds).epsilon_pld()),
        ("central DP, exact RDP of the sampled Gaussian",
         lambda z: PrivacyLedger(delta, [(q, z)] * rounds).epsilon_rdp()),
        ("Gaussian RDP, Zhu and Wang's general amplification",
         lambda z: epsilon_from_rdp([rounds * subsampled_rdp(a, q, lambda j: j / (2 * z * z)) for a in ORDERS], delta)),
        ("distributed DP now: Skellam at a fixed total noise, symmetric amplification",
         lambda z: SkellamLedger(delta, [skellam_round(z)] * rounds).epsilon()),
        ("the same noise, the general bound (09:40-10:45)", lambda z: general([skellam_round(z)] * rounds)),
        ("crediting (k - 1) of a Poisson k, the general bound (until 09:40)", old_rule),
    ]
    print(f"epsilon {args.epsilon:g}, q {q:g}, {rounds} rounds, delta {delta:g}, d {args.numel}")
    print("| accounting | z | against central's PLD |")
    print("|---|---|---|")
    reference = None
    for name, epsilon_at in rows:
        z = smallest_noise(epsilon_at, args.epsilon)
        reference = reference or z
        print(f"| {name} | {z:.3f} | {z / reference:.2f}x |")


if __name__ == "__main__":
    main()
