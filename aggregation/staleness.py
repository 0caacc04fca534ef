"""Staleness weighting for asynchronous aggregation (FedBuff, FedAsync).

An update that started from model version v and arrives when the server is at version t has
staleness τ = t − v. Its contribution is scaled by s(τ) (Xie, Koyejo, Gupta 2019, "Asynchronous
Federated Optimization"; Nguyen et al., AISTATS 2022, "Federated Learning with Buffered Asynchronous
Aggregation", which uses s(τ) = 1/√(1+τ)):

- ``constant``: s(τ) = 1
- ``poly`` (parameter ``a``, default 0.5): s(τ) = (1 + τ)^(−a); a = 0.5 is FedBuff's choice
- ``hinge`` (parameters ``a``, ``b``): s(τ) = 1 for τ ≤ b, else 1 / (a·(τ − b) + 1)

and an update staler than ``max_staleness`` versions is dropped (bounded staleness, as in
stale-synchronous parallel: Ho et al., NeurIPS 2013).

What a reply does to an asynchronous version is here too, once for both coordinators (Fedge's
engine and ``fedge.flower.FedBuff``): a version's :class:`VersionTally` admits it or drops it as
too stale (and counts it), FedBuff adds s(τ)·Δ with the reply's weight to the version's aggregate
(:meth:`VersionTally.add`), FedAsync mixes the client's model into the current one
(:func:`fedasync_mix`), and the tally reports the version's staleness the same way in both.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.aggregation.partial import Accumulator

__all__ = ["STALENESS_FUNCTIONS", "Staleness", "VersionTally", "fedasync_mix"]

STALENESS_FUNCTIONS = ("constant", "poly", "hinge")


@dataclass(frozen=True)
class Staleness:
    function: str = "poly"
    a: float = 0.5
    b: float = 4.0
    max_staleness: int = 20

    def __post_init__(self) -> None:
        if self.function not in STALENESS_FUNCTIONS:
            raise ValueError(f"unknown staleness function {self.function!r}; "
                             f"available: {', '.join(STALENESS_FUNCTIONS)}")
        if not (math.isfinite(self.a) and self.a >= 0):
            raise ValueError(f"staleness parameter a must be finite and >= 0, got {self.a}")
        if not (math.isfinite(self.b) and self.b >= 0):
            raise ValueError(f"staleness parameter b must be finite and >= 0, got {self.b}")
        if self.max_staleness < 0:
            raise ValueError(f"max-staleness must be >= 0, got {self.max_staleness}")

    @property
    def spec(self) -> str:
        params = {"constant": "", "poly": f",a={self.a:g}", "hinge": f",a={self.a:g},b={self.b:g}"}[self.function]
        return f"staleness={self.function}{params},max-staleness={self.max_staleness}"

    def dropped(self, staleness: int) -> bool:
        """Whether an update this stale is discarded (staleness above the bound)."""
        if staleness < 0:
            raise ValueError(f"staleness cannot be negative, got {staleness}")
        return staleness > self.max_staleness

    def weight(self, staleness: int) -> float:
        """s(τ), in (0, 1]."""
        if staleness < 0:
            raise ValueError(f"staleness cannot be negative, got {staleness}")
        if self.function == "constant":
            return 1.0
        if self.function == "poly":
            return (1.0 + staleness) ** (-self.a)
        return 1.0 if staleness <= self.b else 1.0 / (self.a * (staleness - self.b) + 1.0)

    def add(self, aggregate: Accumulator, delta: torch.Tensor, weight: float, staleness: int) -> None:
        """FedBuff's buffer: ``delta`` scaled by s(τ), added with its weight, so the buffer's mean
        is Σ s(τ_i) w_i Δ_i / Σ w_i (the update is not copied when s(τ) = 1)."""
        scale = self.weight(staleness)
        aggregate.add(delta * scale if scale != 1.0 else delta, weight)


@dataclass
class VersionTally:
    """What one asynchronous version took in: the staleness of each update applied to it, and how
    many were dropped as staler than the bound. Both coordinators keep one per version, so a
    version's staleness figures mean the same in a metrics row and in a Flower app's metrics."""

    rule: Staleness
    staleness: list[int] = field(default_factory=list)
    dropped: int = 0

    def admits(self, staleness: int) -> bool:
        """Whether an update this stale may join the version; one that may not is counted as dropped."""
        if self.rule.dropped(staleness):
            self.dropped += 1
            return False
        return True

    def add(self, aggregate: Accumulator, delta: torch.Tensor, weight: float, staleness: int) -> None:
        """FedBuff: the update into the version's ``aggregate``, weighted by s(τ) (:meth:`Staleness.add`)."""
        self.rule.add(aggregate, delta, weight, staleness)
        self.staleness.append(staleness)

    def applied(self, staleness: int) -> None:
        """FedAsync: an update mixed into the model (:func:`fedasync_mix`), not summed."""
        self.staleness.append(staleness)

    def report(self) -> dict[str, Any]:
        """The version's staleness mean, maximum and histogram (None when nothing was applied), and
        the updates dropped as too stale."""
        seen = self.staleness
        return {"staleness_mean": statistics.fmean(seen) if seen else None,
                "staleness_max": max(seen) if seen else None,
                "staleness_histogram": {str(t): seen.count(t) for t in sorted(set(seen))},
                "dropped_stale": self.dropped}


def fedasync_mix(current: torch.Tensor, started_from: torch.Tensor, delta: torch.Tensor, alpha_t: float) -> torch.Tensor:
    """FedAsync's step (Xie, Koyejo and Gupta 2019): x ← (1 − α_t)·x + α_t·x_new, with the client's
    model x_new = x_v + Δ rebuilt from the version v it started from; α_t = α·s(τ). With τ = 0
    it is x + α_t·Δ; a stale client's model pulls x towards where that client went, not x + α_t·Δ."""
    return (1.0 - alpha_t) * current + alpha_t * (started_from + delta)
