"""Compressed federated averaging on Flower's Grid, streaming replies into one accumulator.

FedAvg (McMahan et al., AISTATS 2017, https://arxiv.org/abs/1602.05629) with FedProx on the clients
(Li et al., MLSys 2020) and FedOpt server optimizers (Reddi et al., ICLR 2021).

Unlike Flower's built-in strategies, which call ``send_and_receive`` and hold every reply until all
arrive, this loop pushes the round's messages and pulls replies as they come: each payload is
validated and decoded straight into a running weighted sum and dropped, so coordinator memory is
O(model) for any number of clients. A round closes when every sampled client answered or
``round-timeout`` passed; replies that fail validation are logged with the node and the reason and
left out. After every round: held-out evaluation, one metrics line, an atomic checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from aggregation import StreamingMean, make_server_optimizer
from aggregation.broadcast import Broadcast
from compression import Codec, make_codec, relative_error
from compression.protocol import (
    CONFIG_RECORD,
    DOWNLINK_RECORD,
    METRICS_RECORD,
    MODEL_RECORD,
    PAYLOAD_KEY,
    PAYLOAD_STYPE,
    UPDATE_RECORD,
)
from server.checkpoint import Checkpoint
from server.run_directory import RunDirectory
from server.settings import RunSettings
from tasks import Task, evaluate, flatten_state, tensor_sizes, unflatten_state

__all__ = ["FedAvgLoop", "LoopResult", "NotEnoughNodesError", "initial_params"]

log = logging.getLogger(__name__)

_POLL_START, _POLL_MAX = 0.05, 1.0  # seconds between pulls: quick in simulation, gentle when deployed


class NotEnoughNodesError(RuntimeError):
    """Fewer SuperNodes than ``min-replies`` connected within ``wait-for-nodes`` seconds."""


@dataclass
class LoopResult:
    params: torch.Tensor
    rows: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: int = 0


@dataclass
class _RoundTally:
    mean: StreamingMean
    loss_sum: float = 0.0
    uplink_bytes: int = 0
    used: int = 0
    rejected: list[dict[str, Any]] = field(default_factory=list)


class FedAvgLoop:
    """The round loop. ``run`` resumes from the run directory's checkpoint when there is one."""

    def __init__(
        self,
        settings: RunSettings,
        task: Task,
        run_dir: RunDirectory,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.settings = settings
        self.task = task
        self.run_dir = run_dir
        self._model = task.build_model()
        self._template = self._model.state_dict()
        self.codec: Codec = make_codec(settings.codec).for_model(tensor_sizes(self._template))
        if settings.error_feedback:
            noise = relative_error(self.codec, sum(tensor_sizes(self._template)))
            if noise >= 1.0:
                log.warning(
                    "codec %s has relative squared error %.2f >= 1 (not contractive): error feedback "
                    "can amplify its noise; prefer norm=max, more bits, or error-feedback=false",
                    self.codec.spec, noise,
                )
        self.server_opt = make_server_optimizer(settings.server_opt)
        self.on_round = on_round
        self.downlink: Codec | None = None
        if settings.downlink_codec != "none":
            self.downlink = make_codec(settings.downlink_codec).for_model(tensor_sizes(self._template))
        self._broadcast_state: Broadcast | None = None
        # what one fp32 model costs as a Flower ArrayRecord: the baseline of every compression ratio
        self._fp32_bytes = _record_bytes(ArrayRecord(self._template))
        self._test = task.test_data()

    # -- public ---------------------------------------------------------------------------------
    def run(self, grid: Grid, initial_params: torch.Tensor) -> LoopResult:
        params, start = self._restore(initial_params)
        result = LoopResult(params=params, rows=self.run_dir.metrics.read(), resumed_from=start)
        if start >= self.settings.rounds:
            log.info("run already complete (%d rounds)", start)
            return result
        nodes = self._wait_for_nodes(grid)
        log.info("%d nodes connected; rounds %d..%d", len(nodes), start + 1, self.settings.rounds)
        for server_round in range(start + 1, self.settings.rounds + 1):
            params, row = self._round(grid, server_round, params)
            # Metrics first, then the checkpoint: after a crash in between, the round is re-run and
            # its metrics row replaced (see MetricsLog.truncate_after).
            self.run_dir.metrics.append(row)
            self.run_dir.checkpoints.save(
                Checkpoint(
                    round=server_round,
                    params=params,
                    optimizer_state=self.server_opt.state_dict(),
                    task=self.task.spec,
                )
            )
            result.rows.append(row)
            result.params = params
            if self.on_round:
                self.on_round(row)
        return result

    def evaluate(self, params: torch.Tensor) -> tuple[float, float]:
        self._model.load_state_dict(unflatten_state(params, self._template))
        return evaluate(self._model, self._test)

    # -- internals ------------------------------------------------------------------------------
    def _restore(self, initial_params: torch.Tensor) -> tuple[torch.Tensor, int]:
        checkpoint = self.run_dir.checkpoints.load()
        if checkpoint is None:
            self.run_dir.metrics.truncate_after(0)
            return initial_params.clone(), 0
        if checkpoint.task != self.task.spec or checkpoint.params.numel() != initial_params.numel():
            raise ValueError(
                f"checkpoint in {self.run_dir.path} belongs to task {checkpoint.task!r} "
                f"({checkpoint.params.numel()} parameters), not {self.task.spec!r}"
            )
        self.server_opt.load_state_dict(checkpoint.optimizer_state)
        self.run_dir.metrics.truncate_after(checkpoint.round)
        log.info("resuming from checkpoint after round %d", checkpoint.round)
        return checkpoint.params.clone(), checkpoint.round

    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        wanted = self.settings.clients_per_round
        deadline = time.monotonic() + self.settings.wait_for_nodes
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= wanted or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        if len(nodes) < self.settings.min_replies:
            raise NotEnoughNodesError(
                f"only {len(nodes)} node(s) connected after {self.settings.wait_for_nodes:.0f} s; "
                f"min-replies is {self.settings.min_replies}"
            )
        return nodes

    def _sample(self, grid: Grid, server_round: int) -> list[int]:
        nodes = sorted(grid.get_node_ids())
        count = min(self.settings.clients_per_round, len(nodes))
        # Derived from (seed, round) alone, so a resumed run samples exactly as an uninterrupted one.
        # Node ids are unsigned 64-bit: pick positions, never pass the ids through numpy (float64).
        rng = np.random.default_rng([self.settings.seed, server_round])
        return sorted(nodes[int(i)] for i in rng.choice(len(nodes), size=count, replace=False))

    def _train_config(self, server_round: int) -> ConfigRecord:
        s = self.settings
        return ConfigRecord(
            {
                "round": server_round,
                "task": self.task.spec,
                "partitioning": s.partitioning,
                "codec": self.codec.spec,
                "error-feedback": s.error_feedback,
                "local-epochs": s.local_epochs,
                "batch-size": s.batch_size,
                "lr": s.lr,
                "momentum": s.momentum,
                "prox-mu": s.prox_mu,
                "seed": s.seed,
                "downlink-codec": self.downlink.spec if self.downlink else "none",
                "base-round": server_round - 1,
            }
        )

    def _round(self, grid: Grid, server_round: int, params: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        started = time.perf_counter()
        sampled = self._sample(grid, server_round)
        config = self._train_config(server_round)
        if self.downlink is None:
            messages, sent_bytes = self._broadcast(sampled, params, config, MessageType.TRAIN, str(server_round))
        else:
            messages, sent_bytes = self._broadcast_compressed(sampled, params, config, server_round)
        tally = _RoundTally(mean=StreamingMean(params.numel()))
        wire = self.codec.for_round(server_round, self.settings.seed)  # what the clients encode with
        unanswered = self._collect(grid, messages, lambda reply: self._absorb(reply, tally, server_round, wire))
        for node, reason in unanswered:
            tally.rejected.append({"node": node, "reason": reason})
        if self._broadcast_state is not None:
            failed = {r["node"] for r in tally.rejected}
            for node in sampled:
                if node in failed:
                    self._broadcast_state.forget(node)
                else:
                    self._broadcast_state.confirm(node)
        if tally.used >= self.settings.min_replies:
            stepped = self.server_opt.step(params, tally.mean.mean())
            if bool(torch.isfinite(stepped).all()):
                params = stepped
            else:
                # Each update was finite, but their sum overflowed float32: some client sent values
                # near the float32 limit. Keep the model rather than poison every later round.
                log.error("round %d: the aggregated model is not finite; global model unchanged", server_round)
                tally.rejected.append({"node": None, "reason": "aggregate not finite; round skipped"})
        else:
            log.warning(
                "round %d: %d valid replies < min-replies %d; global model unchanged",
                server_round, tally.used, self.settings.min_replies,
            )
        loss, accuracy = self.evaluate(params)
        client_eval, eval_bytes = self._client_evaluation(grid, server_round, sampled, params, config)
        row = {
            "round": server_round,
            "accuracy": accuracy,
            "loss": loss,
            "train_loss": tally.loss_sum / tally.mean.total_weight if tally.used else None,
            "uplink_bytes": tally.uplink_bytes,
            "uplink_fp32_bytes": tally.used * self._fp32_bytes,
            "downlink_bytes": sent_bytes + eval_bytes,
            "seconds": time.perf_counter() - started,
            "clients_sampled": len(sampled),
            "clients_used": tally.used,
            "clients_failed": len(sampled) - tally.used,
            "codec": self.codec.spec,
            "rejected": tally.rejected,
            **client_eval,
        }
        log.info(
            "round %d: accuracy %.4f loss %.4f | %d/%d clients | uplink %d B (fp32 %d B) | %.1f s",
            server_round, accuracy, loss, tally.used, len(sampled), tally.uplink_bytes,
            row["uplink_fp32_bytes"], row["seconds"],
        )
        return params, row

    def _client_evaluation(
        self, grid: Grid, server_round: int, nodes: list[int], params: torch.Tensor, config: ConfigRecord
    ) -> tuple[dict[str, Any], int]:
        """Federated evaluation of the new global model on the clients' local data, every
        ``client-eval-every`` rounds and at the last round. Returns the metrics and downlink bytes."""
        every = self.settings.client_eval_every
        if not every or (server_round % every and server_round != self.settings.rounds):
            return {}, 0
        messages, sent = self._broadcast(nodes, params, config, MessageType.EVALUATE, f"{server_round}-eval")
        totals = {"examples": 0.0, "loss": 0.0, "correct": 0.0, "replies": 0}

        def absorb(reply: Message) -> None:
            try:
                metrics = reply.content.metric_records[METRICS_RECORD]
                examples = float(metrics["num-examples"])
                loss, accuracy = float(metrics["loss"]), float(metrics["accuracy"])
                if not (examples > 0 and np.isfinite(loss) and 0.0 <= accuracy <= 1.0):
                    raise ValueError(f"implausible evaluation metrics {dict(metrics)}")
            except (KeyError, TypeError, ValueError) as err:
                node = reply.metadata.src_node_id
                log.warning("round %d: ignored evaluation from node %d: %s", server_round, node, err)
                return
            totals["examples"] += examples
            totals["loss"] += loss * examples
            totals["correct"] += accuracy * examples
            totals["replies"] += 1

        self._collect(grid, messages, lambda reply: None if reply.has_error() else absorb(reply))
        if not totals["replies"]:
            return {"client_eval_replies": 0}, sent
        return {
            "client_accuracy": totals["correct"] / totals["examples"],
            "client_loss": totals["loss"] / totals["examples"],
            "client_eval_replies": int(totals["replies"]),
        }, sent

    def _broadcast_compressed(
        self, nodes: list[int], params: torch.Tensor, config: ConfigRecord, server_round: int
    ) -> tuple[list[Message], int]:
        """Up-to-date clients get the encoded change of the public copy, the others the full copy."""
        assert self.downlink is not None
        if self._broadcast_state is None:
            self._broadcast_state = Broadcast(self.downlink, params)
        state = self._broadcast_state
        generator = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + server_round)
        state.advance(params, server_round, generator)
        delta = state.delta or b""
        current = [n for n in nodes if state.is_current(n)]
        stale = [n for n in nodes if not state.is_current(n)]
        messages, sent = self._broadcast(stale, state.public, config, MessageType.TRAIN, str(server_round))
        record = ArrayRecord(
            {PAYLOAD_KEY: Array(dtype="uint8", shape=(len(delta),), stype=PAYLOAD_STYPE, data=delta)}
        )
        for node in current:
            messages.append(
                Message(
                    RecordDict({DOWNLINK_RECORD: record, CONFIG_RECORD: config}),
                    dst_node_id=node,
                    message_type=MessageType.TRAIN,
                    group_id=str(server_round),
                    ttl=self.settings.round_timeout + 60.0,
                )
            )
        return messages, sent + len(current) * len(delta)

    def _broadcast(
        self, nodes: list[int], params: torch.Tensor, config: ConfigRecord, message_type: str, group: str
    ) -> tuple[list[Message], int]:
        """One message per node carrying the model and the config; also the total bytes of models sent
        (each ArrayRecord's serialized arrays, as Flower sends them)."""
        model_record = ArrayRecord(unflatten_state(params, self._template))
        messages = [
            Message(
                RecordDict({MODEL_RECORD: model_record, CONFIG_RECORD: config}),
                dst_node_id=node,
                message_type=message_type,
                group_id=group,
                ttl=self.settings.round_timeout + 60.0,
            )
            for node in nodes
        ]
        return messages, len(nodes) * _record_bytes(model_record)

    def _collect(
        self, grid: Grid, messages: list[Message], handle: Callable[[Message], None]
    ) -> list[tuple[int, str]]:
        """Push ``messages``, feed each reply to ``handle`` as it arrives; return (node, reason) for
        every message that got no reply."""
        ids = list(grid.push_messages(messages))
        missing = [
            (msg.metadata.dst_node_id, "the SuperLink did not accept the message")
            for mid, msg in zip(ids, messages)
            if not mid
        ]
        pending = {mid: msg.metadata.dst_node_id for mid, msg in zip(ids, messages) if mid}
        deadline = time.monotonic() + self.settings.round_timeout
        pause = _POLL_START
        while pending and time.monotonic() < deadline:
            replies = list(grid.pull_messages(list(pending)))
            for reply in replies:
                if pending.pop(reply.metadata.reply_to_message_id, None) is not None:
                    handle(reply)
            if pending:
                pause = _POLL_START if replies else min(pause * 2, _POLL_MAX)
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        timeout = f"no reply within {self.settings.round_timeout:g} s"
        return missing + [(node, timeout) for node in sorted(pending.values())]

    def _absorb(self, reply: Message, tally: _RoundTally, server_round: int, wire: Codec | None = None) -> None:
        """Validate one reply and decode it into the accumulator, or record why it was rejected."""
        node = reply.metadata.src_node_id
        try:
            if reply.has_error():
                raise _Rejected(f"client error {reply.error.code}: {reply.error.reason}")
            payload, examples, train_loss = _unpack_reply(reply)
            tally.mean.add_payload(payload, wire or self.codec, weight=examples)
        except ValueError as err:  # PayloadError and _Rejected are ValueErrors
            log.warning("round %d: rejected update from node %d: %s", server_round, node, err)
            tally.rejected.append({"node": node, "reason": str(err)})
            return
        tally.used += 1
        tally.uplink_bytes += len(payload)
        tally.loss_sum += train_loss * examples


class _Rejected(ValueError):
    pass


def _record_bytes(record: ArrayRecord) -> int:
    """Serialized size of an ArrayRecord's arrays: what Flower sends for it, npy headers included."""
    return sum(len(array.data) for array in record.values())


def _unpack_reply(reply: Message) -> tuple[bytes, float, float]:
    content = reply.content
    if UPDATE_RECORD not in content.array_records:
        raise _Rejected(f"reply has no {UPDATE_RECORD!r} ArrayRecord")
    record = content.array_records[UPDATE_RECORD]
    if PAYLOAD_KEY not in record:
        raise _Rejected(f"{UPDATE_RECORD!r} record has no {PAYLOAD_KEY!r} array")
    array = record[PAYLOAD_KEY]
    if array.stype != PAYLOAD_STYPE or array.dtype != "uint8":
        raise _Rejected(f"payload array has stype {array.stype!r} dtype {array.dtype!r}")
    if METRICS_RECORD not in content.metric_records:
        raise _Rejected(f"reply has no {METRICS_RECORD!r} MetricRecord")
    metrics = content.metric_records[METRICS_RECORD]
    examples = metrics.get("num-examples")
    if not isinstance(examples, int) or isinstance(examples, bool) or examples <= 0:
        raise _Rejected(f"num-examples must be a positive integer, got {examples!r}")
    train_loss = metrics.get("train-loss", 0.0)
    if not isinstance(train_loss, (int, float)) or not np.isfinite(train_loss):
        raise _Rejected(f"train-loss must be a finite number, got {train_loss!r}")
    return array.data, float(examples), float(train_loss)


def initial_params(task: Task, seed: int, init: str = "") -> torch.Tensor:
    """The initial global model as a flat vector: from a model file (cloud pretraining hands off to
    federated fine-tuning) or, without one, the seeded random initialisation of ``task``."""
    torch.manual_seed(seed)
    model = task.build_model()
    if init:
        from deploy.model_file import ModelFileError, load_model_file

        loaded = load_model_file(init)
        if loaded.task != task.spec:
            raise ModelFileError(f"{init} holds a model of task {loaded.task!r}, this run trains {task.spec!r}")
        model.load_state_dict(loaded.state_dict, strict=True)
        log.info("initial model from %s", init)
    return flatten_state(model.state_dict())


