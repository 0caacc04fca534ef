"""Compressed federated averaging: ``algorithm = "fedavg"``.

FedAvg (McMahan et al., AISTATS 2017, https://arxiv.org/abs/1602.05629) with FedProx on the clients
(Li et al., MLSys 2020, ``prox-mu``) and FedOpt server optimizers (Reddi et al., ICLR 2021,
``server-opt``). Each sampled client trains from the global model and sends ``local - global``
encoded with the run's codec (error feedback on the client); each payload is validated and decoded
straight into one running weighted sum (weight = the client's example count) and dropped, so the
coordinator holds O(model) whatever the number of clients. With ``downlink-codec`` the clients known
to hold last round's public copy receive only its encoded change (``aggregation.broadcast``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MessageType, RecordDict

from fedge.aggregation import make_server_optimizer
from fedge.aggregation.broadcast import Broadcast
from fedge.aggregation.robust import Aggregator, aggregator_memory_bytes, make_aggregator, validate_aggregator
from fedge.compression import Codec, derive_seed, make_codec, relative_error
from fedge.protocol import (
    CONFIG_RECORD,
    DOWNLINK_RECORD,
    METRICS_RECORD,
    MODEL_RECORD,
    UPDATE_RECORD,
    message_type_for,
    payload_record,
    read_payload,
)
from fedge.server.engine.algorithm import (
    Algorithm,
    Outgoing,
    Rejected,
    Reply,
    RunContext,
    StepOutcome,
    finite_or_previous,
    reply_metrics,
)
from fedge.server.engine.update_guard import UpdateGuard
from fedge.tasks import tensor_sizes, unflatten_state

__all__ = ["FedAvg"]

log = logging.getLogger(__name__)


class FedAvg(Algorithm):
    name = "fedavg"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        s = ctx.settings
        self.codec: Codec = ctx.codec
        warn_if_not_contractive(self.codec, ctx.numel, s.error_feedback)
        self.server_opt = make_server_optimizer(s.server_opt)
        self.downlink: Codec | None = None
        if s.downlink_codec != "none":
            self.downlink = make_codec(s.downlink_codec).for_model(tensor_sizes(ctx.template))
        self._broadcast: Broadcast | None = None
        self.params = torch.zeros(ctx.numel)
        # Checked here, so the CLI's preflight refuses a rule that would not fit before any process starts.
        validate_aggregator(s.aggregator, ctx.numel, max(s.clients_per_round, 1), s.aggregator_memory_mb * 2**20)
        self.guard = UpdateGuard(s)
        self._agg: Aggregator | None = None
        self._loss_sum = 0.0
        self._loss_weight = 0.0
        self._used: list[int] = []
        self._failed: set[int] = set()
        self._sampled: list[int] = []
        self._eval = {"examples": 0.0, "loss": 0.0, "correct": 0.0, "replies": 0}

    @property
    def spec(self) -> str:
        return "fedavg"

    def start(self, params: torch.Tensor) -> None:
        self.params = params.clone().to(torch.float32)

    def configure(self, step: int, nodes: list[int]) -> list[Outgoing]:
        s = self.ctx.settings
        self._sampled = list(nodes)
        self._agg = make_aggregator(s.aggregator, self.ctx.numel, capacity=max(len(nodes), 1))
        self._loss_sum, self._loss_weight, self._used, self._failed = 0.0, 0.0, [], set()
        self._wire = self.codec.for_round(step, s.seed)  # what the clients encode with this round
        config = self.ctx.round_config(
            step, **{"prox-mu": s.prox_mu, "downlink-codec": self.downlink.spec if self.downlink else "none",
                     "base-round": step - 1}
        ).to_record()
        kind = message_type_for("fedavg")  # FedBuff's clients do FedAvg's work: same handler
        if self.downlink is None:
            model = ArrayRecord(unflatten_state(self.params, self.ctx.template))
            return [Outgoing(n, RecordDict({MODEL_RECORD: model, CONFIG_RECORD: config}), kind) for n in nodes]
        # Compressed downlink: up-to-date clients get the encoded change of the public copy, the
        # others (first round, missed a round, after a restart) the full public copy.
        if self._broadcast is None:
            self._broadcast = Broadcast(self.downlink, self.params)
        state = self._broadcast
        state.advance(self.params, step, torch.Generator().manual_seed(derive_seed(s.seed, step, purpose="downlink")))
        full = ArrayRecord(unflatten_state(state.public, self.ctx.template))
        delta = payload_record(state.delta or b"")
        return [
            Outgoing(n, RecordDict({DOWNLINK_RECORD: delta, CONFIG_RECORD: config}), kind)
            if state.is_current(n) else Outgoing(n, RecordDict({MODEL_RECORD: full, CONFIG_RECORD: config}), kind)
            for n in nodes
        ]

    def absorb(self, step: int, reply: Reply) -> None:
        assert self._agg is not None
        payload = read_payload(reply.content, UPDATE_RECORD)
        metrics = reply_metrics(reply.content)
        update = self._wire.decode(payload, self.ctx.numel)  # validated in full before anything moves
        update = self.guard.bound(step, reply.node, update)
        weight = self.guard.weight(step, reply.node, float(metrics["num-examples"]))
        self._agg.add(update, weight)
        self._loss_sum += float(metrics.get("train-loss", 0.0)) * weight
        self._loss_weight += weight
        self._used.append(reply.node)

    def missed(self, step: int, node: int, reason: str) -> None:
        self._failed.add(node)

    def close(self, step: int) -> StepOutcome:
        assert self._agg is not None
        if self._broadcast is not None:
            for node in self._sampled:
                if node in self._failed:
                    self._broadcast.forget(node)
                else:
                    self._broadcast.confirm(node)
        notes: list[dict[str, Any]] = []
        used = len(self._used)
        extra: dict[str, Any] = {"aggregator": self._agg.spec}
        if not self._agg.streaming:
            extra["aggregator_bytes"] = aggregator_memory_bytes(self._agg.spec, self.ctx.numel, self._agg.capacity)
        if used >= self.ctx.settings.min_replies:
            proposed = self.server_opt.step(self.params, self._agg.result())
            self.params, notes = finite_or_previous(proposed, self.params, step)
            chosen = self._agg.chosen()
            if chosen is not None:
                extra["chosen_nodes"] = [self._used[i] for i in chosen]
        else:
            log.warning("round %d: %d valid replies < min-replies %d; global model unchanged",
                        step, used, self.ctx.settings.min_replies)
        extra.update(self.guard.close_step())
        train_loss = self._loss_sum / self._loss_weight if used else None
        return StepOutcome(model=self.params, train_loss=train_loss, extra=extra, notes=notes)

    # -- federated evaluation: the global model on the clients' local data -----------------------
    def evaluation(self, step: int, nodes: list[int]) -> list[Outgoing]:
        every = self.ctx.settings.client_eval_every
        if not every or (step % every and step != self.ctx.settings.rounds):
            return []
        self._eval = {"examples": 0.0, "loss": 0.0, "correct": 0.0, "replies": 0}
        config = self.ctx.round_config(step).to_record()
        model = ArrayRecord(unflatten_state(self.params, self.ctx.template))
        return [Outgoing(n, RecordDict({MODEL_RECORD: model, CONFIG_RECORD: config}), MessageType.EVALUATE)
                for n in nodes]

    def absorb_evaluation(self, step: int, reply: Reply) -> None:
        if METRICS_RECORD not in reply.content.metric_records:
            raise Rejected("evaluation reply has no metrics")
        metrics = reply.content.metric_records[METRICS_RECORD]
        try:
            examples = float(metrics["num-examples"])
            loss, accuracy = float(metrics["loss"]), float(metrics["accuracy"])
        except (KeyError, TypeError, ValueError) as err:
            raise Rejected(f"implausible evaluation metrics {dict(metrics)}: {err}") from None
        if not (examples > 0 and np.isfinite(loss) and 0.0 <= accuracy <= 1.0):
            raise Rejected(f"implausible evaluation metrics {dict(metrics)}")
        self._eval["examples"] += examples
        self._eval["loss"] += loss * examples
        self._eval["correct"] += accuracy * examples
        self._eval["replies"] += 1

    def close_evaluation(self, step: int) -> dict[str, Any]:
        totals = self._eval
        if not totals["replies"]:
            return {"client_eval_replies": 0}
        return {
            "client_accuracy": totals["correct"] / totals["examples"],
            "client_loss": totals["loss"] / totals["examples"],
            "client_eval_replies": int(totals["replies"]),
        }

    # -- state ------------------------------------------------------------------------------------
    def final_model(self) -> torch.Tensor:
        return self.params.clone()

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.spec, "server_opt": self.server_opt.spec,
                "downlink_codec": self.downlink.spec if self.downlink else "none",
                "aggregator": self.ctx.settings.aggregator, "update_norm": self.guard.norm.spec,
                "weight_cap": self.guard.cap.spec}

    def state_dict(self) -> dict[str, Any]:
        # The downlink's public copy is not saved: after a restart every client gets the full model.
        return {"params": self.params.clone(), "optimizer": self.server_opt.state_dict(),
                "guard": self.guard.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = self.check_flat(state.get("params"), "FedAvg global model")
        optimizer = state.get("optimizer") or {}
        if not isinstance(optimizer, dict):
            raise ValueError("server optimizer state is not a dict")
        for key, value in optimizer.items():
            self.check_flat(value, f"server optimizer state {key!r}")
        self.server_opt.load_state_dict(optimizer)
        self.guard.load_state_dict(state.get("guard") or {})
        self.params = params


def warn_if_not_contractive(codec: Codec, numel: int, error_feedback: bool) -> None:
    if not error_feedback:
        return
    noise = relative_error(codec, numel)
    if noise >= 1.0:
        log.warning(
            "codec %s has relative squared error %.2f >= 1 (not contractive): error feedback "
            "can amplify its noise; prefer norm=max, more bits, or error-feedback=false", codec.spec, noise,
        )
