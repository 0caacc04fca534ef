"""Buffered asynchronous aggregation: ``algorithm = "fedbuff[:concurrency=C,buffer=K,...]"``.

FedBuff (Nguyen et al., AISTATS 2022, https://arxiv.org/abs/2106.06639). The coordinator keeps C
clients training at all times, each from the model version current when its message left. Every
reply is decoded the moment it lands (streaming, O(model)) with the codec of the round its message
named, scaled by the staleness weight s(τ), τ = versions published since it left, and added to a
buffer; after K updates the buffer's mean goes through the server optimizer and a new version is
published. An update staler than ``max-staleness`` versions is dropped and counted. Slow devices
never hold back the others: a synchronous round waits for its slowest sampled client.

The buffer's mean is Σ s(τ_i) w_i Δ_i / Σ w_i with w_i the (capped) example count, so with equal
weights it is FedBuff's (1/K) Σ s(τ_i) Δ_i, and with C = K = every client and no delay it is
exactly synchronous FedAvg's weighted mean (tested). Clients run FedAvg's handler (``train``):
the work on the device is the same; only the coordinator's schedule differs.

Parameters: ``concurrency`` (default clients-per-round), ``buffer`` (K, default half the
concurrency), ``staleness`` = ``constant`` | ``poly`` (s = (1+τ)^−a, default a = 0.5, FedBuff's
choice) | ``hinge`` (1 up to b, then 1/(a(τ−b)+1)), ``max-staleness`` (default 20). ``rounds``
counts published versions. After a coordinator restart, replies to messages sent before it can
never arrive (a restart is a new Flower run); the run continues from the last checkpointed
version with fresh messages.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fedge.aggregation.robust import make_aggregator
from fedge.aggregation.staleness import Staleness, VersionBuffer
from fedge.compression import Codec
from fedge.protocol.failures import FailureKind
from fedge.server.algorithms.fedavg import FedAvg, FedAvgStep
from fedge.server.engine.algorithm import (
    Outgoing,
    Rejected,
    Reply,
    RunContext,
    Step,
    StepOutcome,
    Update,
    finite_or_previous,
)

__all__ = ["FedBuff"]

log = logging.getLogger(__name__)


class FedBuff(FedAvg):
    name = "fedbuff"
    device_handler = "fedavg"  # clients do FedAvg's work; only the coordinator's schedule differs
    settings_used = frozenset({"server-opt", "prox-mu", "aggregator", "downlink-codec", "model-average"})
    asynchronous = True

    def __init__(self, ctx: RunContext, concurrency: int = 0, buffer: int = 0, staleness: str = "poly",
                 a: float = 0.5, b: float = 4.0, max_staleness: int = 20) -> None:
        super().__init__(ctx)
        self.concurrency = int(concurrency) or ctx.settings.clients_per_round
        self.buffer = int(buffer) or max(1, self.concurrency // 2)
        if self.concurrency < 1 or self.buffer < 1:
            raise ValueError(f"fedbuff concurrency and buffer must be >= 1, got {self.concurrency}, {self.buffer}")
        if self.concurrency > ctx.settings.clients_per_round:
            raise ValueError(f"fedbuff concurrency {self.concurrency} exceeds clients-per-round "
                             f"{ctx.settings.clients_per_round} (the nodes the run waits for)")
        self.staleness = Staleness(staleness, a=a, b=b, max_staleness=max_staleness)
        self.versions = VersionBuffer(self.staleness, alpha=self._alpha())

    def _alpha(self) -> float | None:
        """FedAsync's mixing rate (its versions are one update each); FedBuff's: None."""
        return None

    @property
    def version(self) -> int:
        return self.versions.version

    @property
    def spec(self) -> str:
        return f"fedbuff:concurrency={self.concurrency},buffer={self.buffer},{self.staleness.spec}"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "algorithm": self.spec, "concurrency": self.concurrency,
                "buffer": self.buffer}

    def start(self, params: torch.Tensor) -> None:
        super().start(params)
        self.versions.reset(0)

    # -- the engine's asynchronous loop calls these ---------------------------------------------
    def open_step(self, number: int, nodes: list[int]) -> FedAvgStep:
        aggregator = make_aggregator(self.ctx.settings.aggregator, self.ctx.numel, capacity=self.buffer)
        return FedAvgStep(number, list(nodes), aggregate=aggregator)

    def configure(self, step: Step, nodes: list[int]) -> list[Outgoing]:
        """FedAvg's messages; ``step.number`` = version + 1, so every message starts training from the
        current version (with a lattice downlink, what brings each copy from the version it holds)."""
        self.versions.sent(nodes, self._sent_model())
        return super().configure(step, nodes)

    def _sent_model(self) -> torch.Tensor | None:
        """What the versions keep of the model a message carries: FedBuff needs none of it."""
        return None

    def admit(self, step: Step, reply: Reply) -> None:
        """τ = versions published since the reply's message left: an update staler than the bound is
        refused before it is decoded, and counted."""
        if reply.started is None:
            raise Rejected("reply without the version its message started from")
        if self.versions.admit(reply.node, reply.started) is None:
            raise Rejected(f"stale by {self.version - reply.started} versions > max-staleness "
                           f"{self.staleness.max_staleness}; dropped", kind=FailureKind.STALE)

    def reply_codec(self, step: Step, reply: Reply) -> Codec:
        # The codec of the round the client encoded with (its schedule and shared seeds), not today's.
        assert reply.started is not None
        return self.wire(reply.started + 1)

    def absorb(self, step: Step, update: Update) -> None:
        assert isinstance(step, FedAvgStep) and update.started is not None
        self.versions.add(step.aggregate, update.vector, update.weight, update.started)
        step.loss_sum.add(update.train_loss * update.weight)
        step.loss_weight.add(update.weight)
        step.used.append(update.node)

    def missed(self, step: Step, node: int, reason: str) -> None:
        self.versions.missed(node)

    def ready(self, step: Step) -> bool:
        return step.aggregate is not None and step.aggregate.count >= self.buffer

    def close(self, step: Step) -> StepOutcome:
        assert isinstance(step, FedAvgStep)
        model, extra, notes = self._advance(step)
        train_loss = step.loss_sum.value / step.loss_weight.value if step.loss_weight.count else None
        extra.update({**self.versions.publish(step.number), "nodes": list(step.used)})  # whose updates made it
        return StepOutcome(model=model, train_loss=train_loss, extra=extra, notes=notes)

    def _advance(self, step: FedAvgStep) -> tuple[torch.Tensor, dict[str, Any], list[dict[str, Any]]]:
        """The next version: the buffer's mean through the server optimizer (its model, row extras, notes)."""
        aggregator = step.aggregate
        extra: dict[str, Any] = {"version": step.number, "aggregator": aggregator.spec,
                                 "updates_applied": aggregator.count}
        notes: list[dict[str, Any]] = []
        released = step.aggregated()
        if released.count:
            proposed = self.server_opt.step(self.params, released.mean())
            self.params, notes = finite_or_previous(proposed, self.params, step.number)
        return self.params, extra, notes

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version = state.get("version")
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"fedbuff version must be an integer >= 0, got {version!r}")
        super().load_state_dict(state)
        self.versions.reset(version)  # messages sent before a restart can never be answered
