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
from typing import Any

import torch

from fedge.server.algorithms.fedavg import FedAvgStep
from fedge.server.algorithms.fedbuff import FedBuff
from fedge.server.engine.algorithm import Rejected, Reply, RunContext, Step, finite_or_previous

__all__ = ["FedAsync"]

log = logging.getLogger(__name__)


class FedAsync(FedBuff):
    name = "fedasync"
    settings_used = frozenset({"prox-mu", "model-average"})
    weighted = False  # one update per version: its example count mixes nothing

    def __init__(self, ctx: RunContext, alpha: float = 0.6, concurrency: int = 0, staleness: str = "poly",
                 a: float = 0.5, b: float = 4.0, max_staleness: int = 20) -> None:
        if not (math.isfinite(alpha) and 0.0 < alpha <= 1.0):
            raise ValueError(f"fedasync alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        super().__init__(ctx, concurrency=concurrency, buffer=1, staleness=staleness, a=a, b=b,
                         max_staleness=max_staleness)

    def _alpha(self) -> float | None:
        return self.alpha

    @property
    def spec(self) -> str:
        return f"fedasync:alpha={self.alpha:g},concurrency={self.concurrency},{self.staleness.spec}"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "algorithm": self.spec, "alpha": self.alpha}

    def open_step(self, number: int, nodes: list[int]) -> FedAvgStep:
        return FedAvgStep(number, list(nodes))  # one update: nothing to aggregate

    def _sent_model(self) -> torch.Tensor | None:
        return self.params.clone()  # a device's model is rebuilt from the version it started from

    def admit(self, step: Step, reply: Reply) -> None:
        super().admit(step, reply)
        assert reply.started is not None
        if reply.started not in self.versions.models:
            raise Rejected(f"reply to version {reply.started}, which this coordinator never sent")

    def absorb(self, step: Step, update: Any) -> None:
        assert isinstance(step, FedAvgStep) and update.started is not None
        self.versions.add(None, update.vector, 1.0, update.started)
        step.loss_sum.add(update.train_loss)
        step.loss_weight.add(1.0)
        step.used.append(update.node)

    def ready(self, step: Step) -> bool:
        return self.versions.last is not None

    def _advance(self, step: FedAvgStep) -> tuple[torch.Tensor, dict[str, Any], list[dict[str, Any]]]:
        self.versions.forget()  # the version's update holds the model it started from
        extra: dict[str, Any] = {"version": step.number, "updates_applied": 0, "alpha_t": None,
                                 "versions_held": len(self.versions.models)}
        notes: list[dict[str, Any]] = []
        if self.versions.last is not None:
            proposed, alpha_t = self.versions.mixed(self.params)
            self.params, notes = finite_or_previous(proposed, self.params, step.number)
            extra.update(updates_applied=1, alpha_t=alpha_t)
        return self.params, extra, notes
