"""Poisson sampling, the one way a differentially private round chooses its devices: each connected
device independently with probability q, the sampling the accountants' amplification assumes
(central DP's PLD ledger, distributed DP's Skellam RDP). Both DP layers draw through here, from the
OS CSPRNG their callers hand in."""

from __future__ import annotations

import random

__all__ = ["poisson_sample", "sampling_rate"]


def sampling_rate(per_round: int, connected: int) -> float:
    """q = ``per_round`` expected devices over the ``connected`` ones (at most 1)."""
    return min(1.0, per_round / max(connected, 1))


def poisson_sample(nodes: list[int], rate: float, sampler: random.Random) -> list[int]:
    """Each of ``nodes`` (in sorted order, one draw each) independently with probability ``rate``."""
    drawn = [sampler.random() < rate for _ in nodes]
    return [node for node, keep in zip(sorted(nodes), drawn) if keep]
