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

What a reply does to an asynchronous version is here too, once for FedBuff and FedAsync in both
coordinators (Fedge's engine and ``fedge.flower``): the run's :class:`VersionBuffer` knows which
version each device trains from and keeps the model that version was, admits a reply or drops it as
too stale (counted in the version's :class:`VersionTally`), adds s(τ)·Δ with the reply's weight to
the version's aggregate (FedBuff) or keeps the one update that makes the version (FedAsync, mixed
into the current model by :func:`fedasync_mix`), and publishes the version.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.aggregation.partial import Accumulator

__all__ = ["STALENESS_FUNCTIONS", "Staleness", "VersionBuffer", "VersionTally", "fedasync_mix"]

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


class VersionBuffer:
    """An asynchronous run's versions: the version published last (``version``), which version each
    device with a message in flight trains from (``in_flight``), the model each of those versions
    was (``models``, where the caller keeps them: FedAsync rebuilds a device's model from it, a
    Flower app's replies are read against it; none staler than the bound is kept), and what the
    version being built took in: its :class:`VersionTally` and, for FedAsync (``alpha``), its one update."""

    def __init__(self, rule: Staleness, alpha: float | None = None) -> None:
        if alpha is not None and not (math.isfinite(alpha) and 0.0 < alpha <= 1.0):
            raise ValueError(f"fedasync alpha must be in (0, 1], got {alpha}")
        self.rule, self.alpha = rule, alpha
        self.reset(0)

    def reset(self, version: int) -> None:
        """Start at ``version`` with nothing in flight (a new run, or one resumed: messages sent
        before a restart can never be answered)."""
        self.version = version
        self.models: dict[int, torch.Tensor] = {}
        self.in_flight: dict[int, int] = {}
        self.tally = VersionTally(self.rule)
        self.last: tuple[torch.Tensor, torch.Tensor, int] | None = None  # FedAsync: (x_v, Δ, τ)

    def sent(self, nodes: Iterable[int], model: torch.Tensor | None = None) -> None:
        """Messages to ``nodes`` left from the current version (``model``: what it was)."""
        if model is not None:
            self.models.setdefault(self.version, model)
        self.in_flight.update({n: self.version for n in nodes})

    def admit(self, node: int, started: int) -> int | None:
        """τ of ``node``'s reply to a message of version ``started`` (the node is free again), or
        None when it is staler than the bound (counted as dropped)."""
        self.in_flight.pop(node, None)
        tau = self.version - started
        if self.tally.admits(tau):
            return tau
        self.forget()
        return None

    def missed(self, node: int) -> None:
        """``node``'s message went unanswered (or its reply was refused): it is free again."""
        self.in_flight.pop(node, None)
        self.forget()

    def add(self, aggregate: Accumulator | None, delta: torch.Tensor, weight: float, started: int) -> None:
        """An admitted update: ``aggregate`` (FedBuff's buffer; a caller that counts FedAsync's one
        update there too) takes s(τ)·Δ with its weight; FedAsync's version is this update alone."""
        tau = self.version - started
        if aggregate is not None:
            self.tally.add(aggregate, delta, weight, tau)
        else:
            self.tally.applied(tau)
        if self.alpha is not None:  # the model it started from is held here, whatever is forgotten meanwhile
            self.last = (self.models[started], delta, tau)

    def mixed(self, current: torch.Tensor) -> tuple[torch.Tensor, float]:
        """FedAsync: ``current`` with the update's model mixed in (:func:`fedasync_mix`), and α_t."""
        assert self.alpha is not None and self.last is not None
        started_from, delta, tau = self.last
        alpha_t = self.alpha * self.rule.weight(tau)
        return fedasync_mix(current, started_from, delta, alpha_t), alpha_t

    def publish(self, version: int) -> dict[str, Any]:
        """The version being built is out as ``version``: its tally's report; the next one opens."""
        report = self.tally.report()
        self.version, self.tally, self.last = version, VersionTally(self.rule), None
        self.forget()
        return report

    def forget(self) -> None:
        """Drop the models no device trains from any more, or that only a too stale reply would need."""
        keep, oldest = set(self.in_flight.values()), self.version - self.rule.max_staleness
        for v in [v for v in self.models if v not in keep or v < oldest]:
            del self.models[v]


def fedasync_mix(current: torch.Tensor, started_from: torch.Tensor, delta: torch.Tensor, alpha_t: float) -> torch.Tensor:
    """FedAsync's step (Xie, Koyejo and Gupta 2019): x ← (1 − α_t)·x + α_t·x_new, with the client's
    model x_new = x_v + Δ rebuilt from the version v it started from; α_t = α·s(τ). With τ = 0
    it is x + α_t·Δ; a stale client's model pulls x towards where that client went, not x + α_t·Δ."""
    return (1.0 - alpha_t) * current + alpha_t * (started_from + delta)
