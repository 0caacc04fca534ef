"""Compressed federated averaging: ``algorithm = "fedavg"``.

FedAvg (McMahan et al., AISTATS 2017, https://arxiv.org/abs/1602.05629) with FedProx on the clients
(Li et al., MLSys 2020, ``prox-mu``) and FedOpt server optimizers (Reddi et al., ICLR 2021,
``server-opt``). Each sampled client trains from the global model and sends ``local - global``
encoded with the run's codec (error feedback on the client); each payload is validated and decoded
straight into one running weighted sum (weight = the client's example count) and dropped, so the
coordinator holds O(model) whatever the number of clients. The global model rides in each message
as :attr:`Outgoing.model`; the engine's downlink layer ships it (in full, or with
``downlink-codec = "lattice:..."`` as what brings each device's versioned copy up to date).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.aggregation import make_server_optimizer
from fedge.aggregation.exact_sum import ExactScalar
from fedge.aggregation.robust import Aggregator, aggregator_memory_bytes, make_aggregator, validate_aggregator
from fedge.protocol.config_keys import PROX_MU
from fedge.server.engine.algorithm import (
    Algorithm,
    Outgoing,
    RunContext,
    Step,
    StepOutcome,
    Update,
    finite_or_previous,
    warn_if_not_contractive,
)

__all__ = ["FedAvg"]

log = logging.getLogger(__name__)


@dataclass
class FedAvgStep(Step):
    """One round: the streaming (or robust) aggregate and what the metrics row reports of it."""

    # exact sums: the row's train_loss is the same whatever order the replies came in
    loss_sum: ExactScalar = field(default_factory=ExactScalar)
    loss_weight: ExactScalar = field(default_factory=ExactScalar)
    used: list[int] = field(default_factory=list)


class FedAvg(Algorithm):
    name = "fedavg"
    aggregate = "mean"  # the step applies the weighted mean of its updates
    settings_used = frozenset({"server-opt", "prox-mu", "aggregator", "downlink-codec", "model-average"})

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        s = ctx.settings
        warn_if_not_contractive(self.codec, ctx.numel, s.error_feedback)
        self.server_opt = make_server_optimizer(s.server_opt)
        self.params = torch.zeros(ctx.numel)
        # Checked here, so the CLI's preflight refuses a rule that would not fit before any process starts.
        validate_aggregator(s.aggregator, ctx.numel, max(s.clients_per_round, 1), s.aggregator_memory_mb * 2**20)

    @property
    def spec(self) -> str:
        return "fedavg"

    def start(self, params: torch.Tensor) -> None:
        self.params = params.clone().to(torch.float32)

    def open_step(self, number: int, nodes: list[int]) -> FedAvgStep:
        aggregator = make_aggregator(self.ctx.settings.aggregator, self.ctx.numel, capacity=max(len(nodes), 1))
        return FedAvgStep(number, list(nodes), aggregate=aggregator)

    def configure(self, step: Step, nodes: list[int]) -> list[Outgoing]:
        """The global model (the downlink layer ships it) and the round's config, to each node."""
        return self.model_messages(nodes, self.round_config(step.number, **{PROX_MU: self.ctx.settings.prox_mu}),
                                   self.params)

    def absorb(self, step: Step, update: Update) -> None:
        assert isinstance(step, FedAvgStep)
        step.aggregate.add(update.vector, update.weight)
        step.loss_sum.add(update.train_loss * update.weight)
        step.loss_weight.add(update.weight)
        step.used.append(update.node)

    def close(self, step: Step) -> StepOutcome:
        assert isinstance(step, FedAvgStep)
        aggregator = step.aggregate
        assert isinstance(aggregator, Aggregator)
        released = step.aggregated()
        notes: list[dict[str, Any]] = []
        used = released.count
        extra: dict[str, Any] = {"aggregator": aggregator.spec}
        if not aggregator.streaming:
            extra["aggregator_bytes"] = aggregator_memory_bytes(aggregator.spec, self.ctx.numel, aggregator.capacity)
        if released.ready(self.ctx.settings.min_replies):
            proposed = self.server_opt.step(self.params, released.mean())
            self.params, notes = finite_or_previous(proposed, self.params, step.number)
            chosen = aggregator.chosen()
            if chosen is not None:
                extra["chosen_nodes"] = [step.used[i] for i in chosen]
        else:
            log.warning("round %d: %d valid replies < min-replies %d; global model unchanged",
                        step.number, used, self.ctx.settings.min_replies)
        train_loss = step.loss_sum.value / step.loss_weight.value if step.loss_weight.count else None
        return StepOutcome(model=self.params, train_loss=train_loss, extra=extra, notes=notes)

    # -- state ------------------------------------------------------------------------------------
    def final_model(self) -> torch.Tensor:
        return self.params.clone()

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.spec, "server_opt": self.server_opt.spec,
                "aggregator": self.ctx.settings.aggregator}

    def state_dict(self) -> dict[str, Any]:
        return {"params": self.params.clone(), "optimizer": self.server_opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = self.check_flat(state.get("params"), "FedAvg global model")
        optimizer = state.get("optimizer") or {}
        if not isinstance(optimizer, dict):
            raise ValueError("server optimizer state is not a dict")
        for key, value in optimizer.items():
            self.check_flat(value, f"server optimizer state {key!r}")
        self.server_opt.load_state_dict(optimizer)
        self.params = params
