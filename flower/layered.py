"""``layered(strategy, *layers)`` and ``compressed(strategy, uplink=..., downlink=...)``: Fedge's
layers, uplink codecs and downlink around any Message-API strategy (docs/flower.md).

A driver, not a second coordinator: it runs the engine's :class:`~fedge.coordinator.layer.LayerStack`
and door around the strategy's train round, and hands the strategy the models the updates make (or,
when a layer releases its own sum, one model stepped by that sum's mean). ``delivered`` and
``state_dict`` are never called: a Flower app keeps its own model and has no Fedge checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedAvgM, Strategy
from flwr.serverapp.strategy.fedopt import FedOpt
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedge.aggregation.partial import Partial
from fedge.aggregation.streaming_mean import StreamingMean
from fedge.compression import Codec, make_codec
from fedge.coordinator.app_reply import own_config, reply_through_layers, with_extra, with_raw
from fedge.coordinator.driver import StepDriver
from fedge.coordinator.downlink_layer import DownlinkLayer, uplink_codec
from fedge.coordinator.dispatcher import grid_exchange
from fedge.protocol.failures import Failure, FailureKind
from fedge.coordinator.layer import Layer, LayerStack, RunComplete
from fedge.protocol.layout import Layout
from fedge.protocol.records import FEDGE_REPLY_RECORDS, MODEL_RECORD, RAW_RECORD, array_bytes
from fedge.coordinator.step import Outgoing, Reply, Step, StepOutcome, Update
from fedge.coordinator.tally import Tally, resource_summary
from fedge.protocol.uplink_request import UplinkRequest

__all__ = ["CompressedStrategy", "LayeredStrategy", "compressed", "is_plain_mean", "layered", "mean_refusal"]

log = logging.getLogger(__name__)


@dataclass
class _Round:
    driver: StepDriver
    layout: Layout
    arrays: ArrayRecord
    sent: np.ndarray
    wire: Codec | None  # the uplink codec of this round
    sent_at: dict[int, float] = field(default_factory=dict)  # node -> its message's created_at

    @property
    def step(self) -> Step:
        return self.driver.step

    @property
    def tally(self) -> Tally:
        return self.driver.tally


class LayeredStrategy(Strategy):
    """``strategy`` with ``layers`` around its train rounds (see the module docstring); ``uplink``:
    the codec the nodes encode their updates with (None: they send their models). ``summary`` prints
    the wrapper's line before the strategy's, and every attribute the wrapper lacks
    (``fraction_train``, ``weighted_by_key``, ...) is the wrapped strategy's."""

    #: the codec the nodes encode their updates with, the seed of its round randomness, and whether
    #: a plain mean is taken from one running sum (``compressed(..., streaming=True)``)
    uplink: str | None = None
    seed: int = 0
    streaming: bool = False
    #: whether updates leave the devices masked (``secure(...)``): what another wrapper asks first
    masks_updates = False

    def __init__(self, strategy: Strategy, layers: Iterable[Layer], uplink: str | None = None, seed: int = 0,
                 streaming: bool = False) -> None:
        layers = list(layers)
        if getattr(strategy, "masks_updates", False):  # a Flower strategy has none
            raise ValueError("layered(...) and compressed(...) around secure(...) would decode masked uploads: wrap "
                             "them inside it, secure(compressed(strategy, uplink=\"none\", downlink=...)) or "
                             "secure(layered(strategy, *layers))")
        if isinstance(strategy, LayeredStrategy):  # one round with every layer
            if uplink is not None and strategy.uplink is not None:
                raise ValueError("the strategy is compressed(...) already: it has an uplink codec")
            layers, uplink = [*strategy.layers, *layers], uplink if uplink is not None else strategy.uplink
            seed, streaming = (seed, streaming) if strategy.uplink is None else (strategy.seed, strategy.streaming)
            strategy = strategy.strategy
        if uplink is not None:
            downlink = next((layer for layer in layers if isinstance(layer, DownlinkLayer)), None)
            codec = uplink_codec(uplink, downlink)
            if downlink is not None:  # a tcs uplink decodes on the supports the downlink keeps
                downlink.track_supports = codec.shares_support
        if streaming and not is_plain_mean(strategy):
            raise ValueError(f"streaming=True needs a strategy that aggregates by FedAvg's weighted mean; "
                             f"{type(strategy).__name__} has its own aggregate_train")
        self.uplink, self.seed, self.streaming = uplink, int(seed), streaming
        self._wrap(strategy, layers)

    def _wrap(self, strategy: Strategy, layers: Iterable[Layer]) -> None:
        self.strategy = strategy
        self.layers = LayerStack(layers)  # LayerOrderError (a ValueError) with the reason
        releasing = self.layers.releasing
        reason = None if not releasing else mean_refusal(strategy)
        if reason is not None:  # the strategy would aggregate one reply: the released mean
            raise ValueError(f"layer {', '.join(releasing)} releases its own aggregate in place of the updates; "
                             f"{reason}")
        self._round: _Round | None = None
        self.refused: list[tuple[int, int, str]] = []  # (round, node, reason) left out of a round

    @property
    def downlink(self) -> DownlinkLayer | None:
        """The downlink layer (``compressed(..., downlink=...)``), if the round has one."""
        return next((layer for layer in self.layers if isinstance(layer, DownlinkLayer)), None)

    # -- train ----------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        layout = Layout(arrays)
        sent = layout.flatten(arrays)
        params = torch.from_numpy(sent)
        self._round = None
        connected = sorted(grid.get_node_ids())
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        try:
            messages = self._selected(messages, connected, server_round)
        except RunComplete as why:
            log.info("round %d: a layer ends the run here: %s", server_round, why)
            return []
        step = Step(server_round, sorted({m.metadata.dst_node_id for m in messages}), connected=len(connected),
                    exchange=grid_exchange(grid, server_round))
        wire = None if self.uplink is None else make_codec(self.uplink).for_model(layout.sizes()).for_round(
            server_round, self.seed)
        driver = StepDriver(self.layers, step, Tally(time.monotonic()), app=True,
                            heard=lambda failure: self._heard(server_round, failure))
        state = _Round(driver, layout, arrays, sent, wire)
        for message in messages:  # what is written for one node must not reach another
            train_config = own_config(message)
            if self.uplink is not None:
                UplinkRequest(self.uplink, layout.digest, server_round, self.seed).write(train_config)
        outgoing = [Outgoing(m.metadata.dst_node_id, m.content, MessageType.TRAIN, model=params) for m in messages]
        driver.send(outgoing)  # a layer may keep some back
        going = {o.node: o for o in outgoing}
        kept = [m for m in messages if m.metadata.dst_node_id in going]
        for message in kept:
            message.content = going[message.metadata.dst_node_id].content
            state.sent_at[message.metadata.dst_node_id] = message.metadata.created_at
        self._round = state
        return kept

    def _selected(self, messages: list[Message], connected: list[int], server_round: int) -> list[Message]:
        """The strategy's messages, re-addressed to the nodes a layer chose (when one does)."""
        chosen = self.layers.select(connected, len(messages), server_round) if messages else None
        if chosen is None:
            return messages
        return [Message(RecordDict(dict(messages[0].content.items())), node, MessageType.TRAIN,
                        group_id=str(server_round)) for node in chosen]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        state, self._round = self._round, None
        if state is None or state.step.number != server_round:
            return None, None
        replies = list(replies)
        step, layout, key = state.step, state.layout, str(getattr(self.strategy, "weighted_by_key", "num-examples"))
        kept: list[Message] = []
        clear = StreamingMean(layout.numel)  # the engine's running sum (its FedAvg's ``mean``)
        refused_before = len(self.refused)

        def consume(reply: Reply, message: Message) -> Update | None:
            update = self._update(state, message, reply, key)
            if update is not None:  # inside the door: a value beyond the exact sum's range refuses the reply
                clear.add(update.vector, update.weight)
                kept.append(message)
            return update

        for message in replies:  # the one door (``fedge.coordinator.driver``), as in Fedge's engine
            state.driver.take(message, lambda reply, m=message: consume(reply, m))  # type: ignore[misc]
        answered = {m.metadata.src_node_id for m in replies}
        for node in [n for n in step.nodes if n not in answered]:  # the layers hear of it, as in the engine
            state.driver.fail(Failure(node, FailureKind.TIMEOUT, "no reply within the round"))
        released = state.driver.release(clear.partial())
        summed = state.driver.clear
        if released.is_empty:
            arrays, metrics = None, None
        elif released is summed and not self.streaming:
            arrays, metrics = self.strategy.aggregate_train(server_round, kept)
        elif released is summed:  # streaming: FedAvg's weighted mean, from the one running sum
            arrays, metrics = self._streamed(state, released, kept, key)
        else:  # a layer released another sum: the strategy steps from its mean
            stepped = layout.rebuild(state.sent + released.mean().numpy(), state.arrays)
            one = Message(RecordDict({MODEL_RECORD: stepped, "metrics": MetricRecord({key: 1})}),
                          reply_to=Message(RecordDict(), dst_node_id=0, message_type=MessageType.TRAIN))
            arrays, metrics = self.strategy.aggregate_train(server_round, [one])
        outcome = StepOutcome(model=None if arrays is None else torch.from_numpy(Layout(arrays).flatten(arrays)))
        state.driver.close(outcome)
        fedge = state.tally.app_metrics()
        if self.uplink is not None or self.masks_updates:  # masked uploads: their bytes and the key exchange
            fedge.update({"fedge-uplink-bytes": state.tally.uplink, "fedge-refused": len(self.refused) - refused_before})
        if self.masks_updates:  # the secure layer released the survivors' sum (or nothing)
            fedge["fedge-secagg-survivors"] = released.count
        if self.downlink is not None:
            fedge["fedge-downlink-bytes"], self.downlink.bytes = self.downlink.bytes, 0
        return arrays, with_extra(metrics, {**outcome.extra, **fedge})

    def _streamed(self, state: _Round, released: Partial, kept: list[Message],
                  key: str) -> tuple[ArrayRecord, MetricRecord | None]:
        """FedAvg's weighted mean without one decoded model per reply: the sent model plus the
        running sum's mean; integer buffers and metrics as the strategy takes them."""
        layout, like = state.layout, state.arrays
        floats = {name for name, _, _ in layout.floats}
        raw_names = [name for name, _, _ in layout.entries if name not in floats]
        if raw_names:  # integer buffers: the weighted mean of the clients' own, as FedAvg takes it
            raws = [RecordDict({"raw": ArrayRecord({n: r.content.array_records.get(RAW_RECORD, like)[n]
                                                    for n in raw_names}),
                                "metrics": next(iter(r.content.metric_records.values()))}) for r in kept]
            like = with_raw(like, aggregate_arrayrecords(raws, key))
        arrays = layout.rebuild(state.sent + released.mean().numpy(), like)
        contents = [RecordDict(dict(r.content.metric_records.items())) for r in kept]
        return arrays, self.strategy.train_metrics_aggr_fn(contents, key)  # type: ignore[attr-defined]

    def _update(self, state: _Round, message: Message, reply: Reply, key: str) -> Update | None:
        """One reply through the layers' part of the door (:func:`reply_through_layers`; None: a
        layer took it whole); the reply's content then holds the model the update makes. Raises
        what refuses it."""
        step, layout, node = state.step, state.layout, message.metadata.src_node_id
        sent_at = state.sent_at.get(node)
        reply.seconds = None if sent_at is None else max(0.0, message.metadata.created_at - sent_at)
        wire = state.wire if state.wire is None or self.downlink is None else self.downlink.bind(state.wire, node)
        update, original = reply_through_layers(self.layers, step, message, reply, layout, wire,
                                                None if wire is not None else state.sent, key)
        if update is None:
            return None  # every layer saw it; one consumed it
        assert original is not None
        records, metrics = message.content.array_records, original.metrics
        name = MODEL_RECORD if wire is not None else next(n for n in records if n not in FEDGE_REPLY_RECORDS)
        record = with_raw(state.arrays, records.get(RAW_RECORD, ArrayRecord())) if wire is not None else records[name]
        if (update is not original or state.wire is not None) and not self.streaming:
            # what the layers made of the update, as the model the strategy aggregates
            content = RecordDict({n: r for n, r in message.content.items() if n not in FEDGE_REPLY_RECORDS})
            content[name] = layout.rebuild(state.sent + update.vector.numpy(), record)
            if update is not original:
                content[next(iter(message.content.metric_records), "metrics")] = MetricRecord({**metrics,
                                                                                              key: update.weight})
            message.content = content
        return update

    def _heard(self, server_round: int, failure: Failure) -> None:
        """A reply left out of the round (the door or the layer that dropped it logged why; a silence
        is counted by kind, not refused)."""
        if failure.kind is FailureKind.TIMEOUT:
            log.info("round %d: no reply from node %s", server_round, failure.node)
            return
        if failure.kind is FailureKind.CLIENT_ERROR:
            log.warning("round %d: refused the reply of node %s: %s", server_round, failure.node, failure.reason)
        self.refused.append((server_round, failure.node, failure.reason))

    # -- evaluate: the downlink ships the model there too ---------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        if self.downlink is None or not messages:
            return messages
        if self.downlink.track_supports:  # a tcs uplink sends on what the next train message moves: an
            # evaluation that brought the copies current would leave that empty; it carries the arrays, counted
            self.downlink.bytes += sum(array_bytes(m.content, (MODEL_RECORD,)) for m in messages)
            return messages
        params = torch.from_numpy(Layout(arrays).flatten(arrays))
        for message in messages:
            own_config(message)
        outgoing = [Outgoing(m.metadata.dst_node_id, m.content, MessageType.EVALUATE, model=params)
                    for m in messages]
        self.downlink.outgoing(Step(server_round), outgoing)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The wrapped strategy's, over the replies the one door lets through (``fedge.coordinator.door``:
        a device's typed refusal is logged and left out, as in a train round; Flower's error replies
        pass on, for the strategy to count); with a downlink, each reply confirms the copy its
        message brought (under a ``tcs`` uplink none brought one), a failure forgets it, and the metrics
        gain ``fedge-downlink-bytes``."""
        downlink, passed = self.downlink, []
        copies = None if downlink is None or downlink.track_supports else downlink  # what configure_evaluate shipped
        driver = StepDriver(LayerStack([] if copies is None else [copies]), Step(server_round), Tally(0.0), app=True)

        def take(reply: Reply, message: Message) -> None:
            passed.append(message)
            if copies is not None:
                copies.arrived(driver.step, reply)

        for message in replies:
            failure = driver.take(message, lambda reply, m=message: take(reply, m), what="evaluation")  # type: ignore[misc]
            if failure is not None and failure.kind is FailureKind.CLIENT_ERROR:
                passed.append(message)
        metrics = self.strategy.aggregate_evaluate(server_round, passed)
        extra: dict[str, object] = {"fedge-device-resources": resource_summary(driver.tally.resources)}
        if downlink is not None and downlink.bytes:
            extra["fedge-downlink-bytes"], downlink.bytes = downlink.bytes, 0
        return with_extra(metrics, extra)

    def summary(self) -> None:
        log.info("%s (fedge.flower), wrapping:", self.describe())
        self.strategy.summary()

    def __getattr__(self, name: str) -> object:
        if name == "strategy":  # not set yet (inside __init__): no recursion
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def describe(self) -> str:
        parts = [f"compressed uplink: {self.uplink}"] if self.uplink is not None else []
        if self.downlink is not None:
            parts.append(f"downlink: {self.downlink.spec}")
        others = [layer.key for layer in self.layers if layer is not self.downlink]
        return ", ".join(parts + ([f"layers {', '.join(others)}"] if others else [])) or "layered"


class CompressedStrategy(LayeredStrategy):
    """``strategy`` whose clients (:func:`fedge.flower.compression_mod`) send updates encoded with the
    codec ``uplink`` names, and whose model goes out as ``downlink`` says (``lattice[:ratio=...]``: a
    versioned lattice change). ``streaming=True`` (FedAvg's weighted mean only) decodes each reply
    straight into one sum; ``start="pkg.task:Net@0"`` names how the nodes build the start model, which
    the lattice then never sends (``fedge.protocol.start_model``)."""

    def __init__(self, strategy: Strategy, uplink: str = "qsgd:bits=4", seed: int = 0, downlink: str = "none",
                 streaming: bool = False, start: str | None = None) -> None:
        super().__init__(strategy, [DownlinkLayer.for_app(downlink, start=start)], uplink=uplink, seed=seed,
                         streaming=streaming)


def is_plain_mean(strategy: Strategy) -> bool:
    """Whether ``strategy`` aggregates train replies by FedAvg's weighted mean (FedAvg, FedProx, ...)."""
    return isinstance(strategy, FedAvg) and type(strategy).aggregate_train is FedAvg.aggregate_train


def mean_refusal(strategy: Strategy) -> str | None:
    """Why ``strategy`` cannot step from one released mean (secure aggregation's sum, a DP release)
    in place of the round's updates (None: it can: FedAvg, FedProx, FedAvgM, the server optimizers)."""
    if is_plain_mean(strategy) or isinstance(strategy, (FedOpt, FedAvgM)):
        return None
    return (f"{type(strategy).__name__} aggregates each update itself (it ranks, trims or reweights them), and "
            "only their sum is released")


def layered(strategy: Strategy, *layers: Layer) -> LayeredStrategy:
    """Wrap ``strategy`` so ``layers`` (instances of :class:`fedge.coordinator.layer.Layer`, the same
    classes Fedge's engine runs) act on its train rounds; see the module docstring."""
    return LayeredStrategy(strategy, layers)


#: ``compressed(strategy, uplink="qsgd:bits=4", seed=0, downlink="none", streaming=False, start=None)``
compressed = CompressedStrategy
