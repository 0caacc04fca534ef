"""Asynchronous federated optimization: ``algorithm = "fedasync[:alpha=0.6,concurrency=C,...]"``.

FedAsync (Xie, Koyejo, Gupta 2019, https://arxiv.org/abs/1903.03934). Every reply is a new model
version: the coordinator mixes the client's model into the global one,

    x ← (1 − α_t)·x + α_t·x_new,   α_t = α·s(τ),

with τ = versions published since the client's message left and s the staleness function FedBuff
uses (``constant``, ``poly`` (1+τ)^−a, ``hinge``). Clients upload a compressed *update*
Δ = x_new − x_v relative to the version v they started from, so the coordinator rebuilds
x_new = x_v + Δ from its copy of x_v. It therefore holds every version some client is still
training from, at most ``min(concurrency, max-staleness + 1)`` models: the metrics row's
``versions_held`` says how many (``max-staleness`` bounds it; an update staler than that is dropped
and counted, as in FedBuff). With τ = 0 the rule is x ← x + α·Δ.

FedAsync applies no server optimizer and no robust aggregator (one update per step: there is
nothing to aggregate); the update-norm bound applies as for every algorithm, and the client's
proximal term (``prox-mu``, the paper's ρ) is available. Clients run FedAvg's handler.

Defaults: α = 0.6 (the paper's experiments use α ∈ {0.6, 0.9}) and the paper's polynomial
staleness with a = 0.5. ``rounds`` counts versions, that is accepted updates: a FedAsync run of
``rounds`` R does as much client work as a FedAvg run of R / clients-per-round rounds.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from fedge.aggregation.staleness import VersionTally, fedasync_mix
from fedge.server.algorithms.fedbuff import FedBuff, FedBuffStep
from fedge.server.engine.algorithm import Outgoing, Rejected, Reply, RunContext, Step, StepOutcome, Update, finite_or_previous

__all__ = ["FedAsync"]

log = logging.getLogger(__name__)


@dataclass
class FedAsyncStep(FedBuffStep):
    """One version: the single update that makes it, as (x_v, Δ, α_t)."""

    pending: tuple[torch.Tensor, torch.Tensor, float] | None = None


class FedAsync(FedBuff):
    name = "fedasync"
    settings_used = frozenset({"prox-mu", "model-average"})
    weighted = False  # one update per version: its example count mixes nothing

    def __init__(self, ctx: RunContext, alpha: float = 0.6, concurrency: int = 0, staleness: str = "poly",
                 a: float = 0.5, b: float = 4.0, max_staleness: int = 20) -> None:
        if not (math.isfinite(alpha) and 0.0 < alpha <= 1.0):
            raise ValueError(f"fedasync alpha must be in (0, 1], got {alpha}")
        super().__init__(ctx, concurrency=concurrency, buffer=1, staleness=staleness, a=a, b=b,
                         max_staleness=max_staleness)
        self.alpha = float(alpha)
        self._versions: dict[int, torch.Tensor] = {}  # version -> model, while a client trains from it
        self._in_flight: dict[int, int] = {}  # node -> the version its message carried

    @property
    def spec(self) -> str:
        return f"fedasync:alpha={self.alpha:g},concurrency={self.concurrency},{self.staleness.spec}"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "algorithm": self.spec, "alpha": self.alpha}

    def start(self, params: torch.Tensor) -> None:
        super().start(params)
        self._versions.clear()
        self._in_flight.clear()

    def open_step(self, number: int, nodes: list[int]) -> FedAsyncStep:
        return FedAsyncStep(number, list(nodes), tally=VersionTally(self.staleness))

    def configure(self, step: Step, nodes: list[int]) -> list[Outgoing]:
        version = step.number - 1
        self._versions.setdefault(version, self.params.clone())
        for node in nodes:
            self._in_flight[node] = version
        return super().configure(step, nodes)

    def admit(self, step: Step, reply: Reply) -> None:
        self._in_flight.pop(reply.node, None)
        try:
            super().admit(step, reply)
        except Rejected:
            self._forget_versions()
            raise
        assert reply.started is not None
        if reply.started not in self._versions:
            raise Rejected(f"reply to version {reply.started}, which this coordinator never sent")

    def absorb(self, step: Step, update: Update) -> None:
        assert isinstance(step, FedAsyncStep) and update.started is not None
        tau = self.version - update.started
        step.pending = (self._versions[update.started], update.vector, self.alpha * self.staleness.weight(tau))
        self._forget_versions()
        step.loss_sum.add(update.train_loss)
        step.loss_weight.add(1.0)
        step.used.append(update.node)
        step.tally.applied(tau)

    def missed(self, step: Step, node: int, reason: str) -> None:
        self._in_flight.pop(node, None)
        self._forget_versions()

    def ready(self, step: Step) -> bool:
        assert isinstance(step, FedAsyncStep)
        return step.pending is not None

    def close(self, step: Step) -> StepOutcome:
        assert isinstance(step, FedAsyncStep)
        extra: dict[str, Any] = {
            "version": step.number, "updates_applied": 0, "alpha_t": None,
            **step.tally.report(),
            "nodes": list(step.used),
        }
        notes: list[dict[str, Any]] = []
        if step.pending is not None:
            started_from, delta, alpha_t = step.pending
            proposed = fedasync_mix(self.params, started_from, delta, alpha_t)
            self.params, notes = finite_or_previous(proposed, self.params, step.number)
            extra.update(updates_applied=1, alpha_t=alpha_t)
        train_loss = step.loss_sum.value / step.loss_weight.value if step.loss_weight.count else None
        extra["versions_held"] = len(self._versions)
        self.version = step.number
        self._forget_versions()
        return StepOutcome(model=self.params, train_loss=train_loss, extra=extra, notes=notes)

    def _forget_versions(self) -> None:
        """Drop the models no client trains from any more (or that would be dropped as too stale)."""
        keep = set(self._in_flight.values())
        oldest = self.version - self.staleness.max_staleness
        for v in [v for v in self._versions if v not in keep or v < oldest]:
            del self._versions[v]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # Messages sent before a restart can never be answered (a restart is a new Flower run).
        self._versions.clear()
        self._in_flight.clear()
