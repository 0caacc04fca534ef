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
import statistics
from typing import Any

import torch
from flwr.app import ArrayRecord, RecordDict

from fedge.aggregation.robust import make_aggregator
from fedge.aggregation.staleness import Staleness
from fedge.protocol import CONFIG_RECORD, MODEL_RECORD, UPDATE_RECORD, message_type_for, read_payload
from fedge.server.engine.algorithm import (
    Outgoing,
    Rejected,
    Reply,
    RunContext,
    StepOutcome,
    finite_or_previous,
    reply_metrics,
)
from fedge.server.algorithms.fedavg import FedAvg
from fedge.tasks import unflatten_state

__all__ = ["FedBuff"]

log = logging.getLogger(__name__)


class FedBuff(FedAvg):
    name = "fedbuff"
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
        self.version = 0
        self._new_buffer()

    @property
    def spec(self) -> str:
        return f"fedbuff:concurrency={self.concurrency},buffer={self.buffer},{self.staleness.spec}"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "algorithm": self.spec, "concurrency": self.concurrency,
                "buffer": self.buffer}

    def _new_buffer(self) -> None:
        s = self.ctx.settings
        self._agg = make_aggregator(s.aggregator, self.ctx.numel, capacity=self.buffer)
        self._loss_sum, self._loss_weight, self._used = 0.0, 0.0, []
        self._staleness: list[int] = []
        self._dropped = 0

    def start(self, params: torch.Tensor) -> None:
        super().start(params)
        self.version = 0
        self._new_buffer()

    # -- the engine's asynchronous loop calls these ---------------------------------------------
    def configure(self, step: int, nodes: list[int]) -> list[Outgoing]:
        """Messages that start training from the current version (``step`` = version + 1)."""
        config = self.ctx.round_config(step, **{"prox-mu": self.ctx.settings.prox_mu, "downlink-codec": "none",
                                                "base-round": step - 1}).to_record()
        model = ArrayRecord(unflatten_state(self.params, self.ctx.template))
        kind = message_type_for("fedavg")
        return [Outgoing(n, RecordDict({MODEL_RECORD: model, CONFIG_RECORD: config}), kind) for n in nodes]

    def _staleness_of(self, reply: Reply) -> int:
        """τ = versions published since the reply's message left; raises :class:`Rejected` (and
        counts it) for an update staler than the bound."""
        if reply.started is None:
            raise Rejected("reply without the version its message started from")
        tau = self.version - reply.started
        if self.staleness.dropped(tau):
            self._dropped += 1
            raise Rejected(f"stale by {tau} versions > max-staleness {self.staleness.max_staleness}; dropped")
        return tau

    def _decode(self, step: int, reply: Reply) -> tuple[torch.Tensor, dict[str, Any]]:
        """The reply's update within the norm bound, and its metrics."""
        assert reply.started is not None
        payload = read_payload(reply.content, UPDATE_RECORD)
        metrics = reply_metrics(reply.content)
        # The codec of the round the client encoded with (its schedule and shared seeds), not today's.
        wire = self.codec.for_round(reply.started + 1, self.ctx.settings.seed)
        return self.guard.bound(step, reply.node, wire.decode(payload, self.ctx.numel)), metrics

    def absorb(self, step: int, reply: Reply) -> None:
        tau = self._staleness_of(reply)
        update, metrics = self._decode(step, reply)
        weight = self.guard.weight(step, reply.node, float(metrics["num-examples"]))
        scale = self.staleness.weight(tau)
        self._agg.add(update * scale if scale != 1.0 else update, weight)
        self._loss_sum += float(metrics.get("train-loss", 0.0)) * weight
        self._loss_weight += weight
        self._used.append(reply.node)
        self._staleness.append(tau)

    def missed(self, step: int, node: int, reason: str) -> None:
        pass

    def ready(self) -> bool:
        return self._agg.count >= self.buffer

    def close(self, step: int) -> StepOutcome:
        assert self._agg is not None
        extra: dict[str, Any] = {
            "version": step, "aggregator": self._agg.spec, "updates_applied": self._agg.count,
            "staleness_mean": statistics.fmean(self._staleness) if self._staleness else None,
            "staleness_max": max(self._staleness) if self._staleness else None,
            "staleness_histogram": {str(t): self._staleness.count(t) for t in sorted(set(self._staleness))},
            "dropped_stale": self._dropped,
            "nodes": list(self._used),  # whose updates made this version
        }
        notes: list[dict[str, Any]] = []
        if self._agg.count:
            proposed = self.server_opt.step(self.params, self._agg.result())
            self.params, notes = finite_or_previous(proposed, self.params, step)
        train_loss = self._loss_sum / self._loss_weight if self._loss_weight else None
        extra.update(self.guard.close_step())
        self.version = step
        self._new_buffer()
        return StepOutcome(model=self.params, train_loss=train_loss, extra=extra, notes=notes)

    def evaluation(self, step: int, nodes: list[int]) -> list[Outgoing]:
        return []  # federated evaluation is a synchronous exchange; not part of asynchronous runs

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version = state.get("version")
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"fedbuff version must be an integer >= 0, got {version!r}")
        super().load_state_dict(state)
        self.version = version
        self._new_buffer()
