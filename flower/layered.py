"""``layered(strategy, *layers)``: Fedge's engine layers around any Message-API strategy.

A layer (:class:`fedge.protocol.layer.Layer`) is written once, against one step's types
(``fedge.protocol.step``). Fedge's engine calls its hooks around every algorithm's step; this
wrapper calls the same hooks, in the same order (:func:`~fedge.protocol.layer.order_layers`), around
a Flower strategy's train round, so one layer class works in both coordinators:

- ``start`` once, from the first round's model; ``exhausted``: a round the layer forbids sends nothing;
- ``select``: a layer that chooses the round's nodes re-addresses the strategy's message to them;
- ``open`` with an exchange over the user's grid, then ``outgoing`` on each train message;
- per reply: ``missed`` for an error reply, ``arrived`` (a layer may take a reply whole), then
  ``update`` on the reply's change from the sent model, with its weight (the strategy's
  ``weighted_by_key``); what a layer made of the update is what the strategy aggregates;
- ``settle``; then ``release`` on the round's :class:`~fedge.aggregation.partial.Partial`: when a
  layer releases another one (an unmasked or noised sum), the strategy aggregates one reply, the
  sent model plus that mean (``fedge.flower.secure`` is this wrapper with the engine's
  secure-aggregation layer, ``fedge.protocol.secure_layer``);
- ``close``: what a layer adds to the outcome's ``extra`` becomes the round's train metrics
  (numbers as they are, one level of dicts as ``name.key``).

Wrap it inside ``compressed()`` or ``secure()`` (``compressed(layered(FedAvg(), layer), ...)``):
it acts on the models the replies carry, which those wrappers decode or unmask. Not called here:
``delivered`` and the layer's ``state_dict`` (a Flower app's ServerApp keeps its
own model and has no checkpoint of Fedge's). Nothing here imports Fedge's coordinator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedge.aggregation.partial import Partial
from fedge.protocol.layout import Layout
from fedge.flower.messages import REFUSED, Wrapper, grid_stages
from fedge.flower.strategy import CompressedStrategy
from fedge.protocol.dispatcher import Missing
from fedge.protocol.failures import Failure, FailureKind
from fedge.protocol.layer import Exchange, Layer, order_layers
from fedge.protocol.records import MODEL_RECORD, RAW_RECORD, UPDATE_RECORD, ProtocolError, read_payload
from fedge.protocol.step import Outgoing, Reply, Step, StepOutcome, Update
from fedge.protocol.tally import Tally

__all__ = ["LayeredStrategy", "layered"]

log = logging.getLogger(__name__)


@dataclass
class _Round:
    step: Step
    tally: Tally
    layout: Layout
    arrays: ArrayRecord
    sent: np.ndarray
    exchange: Exchange


class LayeredStrategy(Wrapper):
    """``strategy`` with ``layers`` around its train rounds (see the module docstring)."""

    def __init__(self, strategy: Strategy, layers: Iterable[Layer]) -> None:
        if isinstance(strategy, CompressedStrategy) or getattr(strategy, "masks_updates", False):
            raise ValueError("layered(...) acts on the models the replies carry: wrap it inside compressed() or "
                             "secure(), e.g. compressed(layered(FedAvg(), layer), uplink=...)")
        self._wrap(strategy, layers)

    def _wrap(self, strategy: Strategy, layers: Iterable[Layer]) -> None:
        self.strategy = strategy
        self.layers = order_layers(list(layers))  # LayerOrderError (a ValueError) with the reason
        self._started = False
        self._round: _Round | None = None
        self.refused: list[tuple[int, int, str]] = []  # (round, node, reason) left out of a round

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        layout = Layout(arrays)
        sent = layout.flatten(arrays)
        params = torch.from_numpy(sent)
        if not self._started:
            for layer in self.layers:
                layer.start(params)
            self._started = True
        self._round = None
        connected = sorted(grid.get_node_ids())
        if any(layer.exhausted(len(connected)) for layer in self.layers):
            log.info("round %d: a layer ends the run here (its budget is spent)", server_round)
            return []
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        messages = self._selected(messages, connected, server_round)
        step = Step(server_round, sorted({m.metadata.dst_node_id for m in messages}), connected=len(connected))
        state = _Round(step, Tally(time.monotonic()), layout, arrays, sent, _exchange(grid, server_round))
        for layer in self.layers:
            for failure in layer.open(step, state.exchange):
                self._missed(state, failure)
        kept = [m for m in messages if m.metadata.dst_node_id in set(step.nodes)]
        outgoing = [Outgoing(m.metadata.dst_node_id, RecordDict(dict(m.content.items())), MessageType.TRAIN,
                             model=params) for m in kept]
        for layer in self.layers:
            layer.outgoing(step, outgoing)
        for message, out in zip(kept, outgoing):
            message.content = out.content
        state.tally.sent(outgoing)
        self._round = state
        return kept

    def _selected(self, messages: list[Message], connected: list[int], server_round: int) -> list[Message]:
        """The strategy's messages, re-addressed to the nodes a layer chose (when one does)."""
        if not messages:
            return messages
        for layer in self.layers:
            chosen = layer.select(list(connected), len(messages), server_round)
            if chosen is not None:
                template = messages[0]
                return [Message(RecordDict(dict(template.content.items())), node, MessageType.TRAIN,
                                group_id=str(server_round)) for node in chosen]
        return messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        state, self._round = self._round, None
        if state is None or state.step.number != server_round:
            return None, None
        replies = list(replies)
        step, layout, key = state.step, state.layout, str(getattr(self.strategy, "weighted_by_key", "num-examples"))
        kept: list[Message] = []
        total, weight = torch.zeros(layout.numel, dtype=torch.float32), 0.0
        for message in replies:
            node = message.metadata.src_node_id
            if message.has_error():
                self._missed(state, Failure(node, FailureKind.CLIENT_ERROR,
                                            f"client error {message.error.code}: {message.error.reason}"))
                continue
            try:
                update = self._update(state, message, key)
            except REFUSED as err:  # what the engine's door refuses, refused here too: logged, left out
                self._missed(state, Failure(node, FailureKind.INVALID, str(err)))
                continue
            if update is None:  # a layer took the reply whole
                continue
            total += update.weight * update.vector
            weight += update.weight
            state.tally.members.append(node)
            kept.append(message)
        for layer in self.layers:
            for failure in layer.settle(step, state.exchange, state.tally):
                self._missed(state, failure)
        clear = Partial.of_sum(total, weight, len(kept), members=tuple(state.tally.members)) if kept \
            else Partial.empty(layout.numel)
        released = clear
        for layer in self.layers:
            released = layer.release(step, released)
        step.released = released
        state.tally.used = released.count
        if released is clear:
            arrays, metrics = self.strategy.aggregate_train(server_round, kept)
        elif released.is_empty:
            arrays, metrics = None, None
        else:  # a layer released another sum: the strategy steps from its mean
            stepped = layout.rebuild(state.sent + released.mean().numpy(), state.arrays)
            one = Message(RecordDict({MODEL_RECORD: stepped, "metrics": MetricRecord({key: 1})}),
                          reply_to=Message(RecordDict(), dst_node_id=0, message_type=MessageType.TRAIN))
            if isinstance(self.strategy, CompressedStrategy):  # its downlink settles on the real replies
                arrays, metrics = self.strategy.aggregate_released(server_round, replies, [one])
            else:
                arrays, metrics = self.strategy.aggregate_train(server_round, [one])
        outcome = StepOutcome(model=None if arrays is None else torch.from_numpy(Layout(arrays).flatten(arrays)))
        for layer in self.layers:
            layer.close(step, outcome, state.tally)
        return arrays, self._metrics(state, _with_extra(metrics, outcome.extra))

    def _metrics(self, state: _Round, metrics: MetricRecord | None) -> MetricRecord | None:
        """The round's train metrics (a wrapper over one layer adds that layer's own names here)."""
        return metrics

    def _update(self, state: _Round, message: Message, key: str) -> Update | None:
        """One reply through the layers' ``arrived`` and ``update`` (None: a layer took it whole);
        the reply's content then holds what the layers made of it. Raises what refuses it."""
        step, layout, node = state.step, state.layout, message.metadata.src_node_id
        metrics = dict(next(iter(message.content.metric_records.values()), MetricRecord()))
        payload = memoryview(read_payload(message.content, UPDATE_RECORD)
                             if UPDATE_RECORD in message.content.array_records else b"")
        if any([layer.arrived(step, Reply(node, message.content), payload, metrics) for layer in self.layers]):
            return None  # every layer saw it; one consumed it
        name = next((n for n in message.content.array_records if n not in (UPDATE_RECORD, RAW_RECORD)), None)
        if name is None:
            raise ProtocolError("a train reply without its model's arrays")
        record = message.content.array_records[name]
        vector = torch.from_numpy(layout.flatten(record) - state.sent)
        if not torch.isfinite(vector).all():
            raise ProtocolError("the reply's model holds NaN or infinite values")
        update = original = Update(node, vector, float(metrics.get(key, 1.0)), metrics, bytes(payload),
                                   message.content)
        for layer in self.layers:
            update = layer.update(step, update)
        if update is not original:  # what the layers made of the update (untouched: the reply's own bytes)
            content = RecordDict(dict(message.content.items()))
            content[name] = layout.rebuild(state.sent + update.vector.numpy(), record)
            content[next(iter(message.content.metric_records), "metrics")] = MetricRecord({**metrics,
                                                                                          key: update.weight})
            message.content = content
        return update

    def _missed(self, state: _Round, failure: Failure) -> None:
        log.warning("round %d: node %d left out: %s", state.step.number, failure.node, failure.reason)
        state.tally.failed(failure)
        self.refused.append((state.step.number, failure.node, failure.reason))
        for layer in self.layers:
            layer.missed(state.step, failure)

    def describe(self) -> str:
        return f"layers {', '.join(layer.key for layer in self.layers)}"


def _exchange(grid: Grid, server_round: int) -> Exchange:
    """A layer's own exchange (key agreement, ...) as ``train`` messages on the user's grid."""
    stages = grid_stages(grid, server_round)

    def run(outgoing: list[Outgoing], timeout: float, label: str):  # type: ignore[no-untyped-def]
        for item in stages([(o.node, o.content) for o in outgoing], timeout, label):
            yield Missing(item[0], item[1]) if isinstance(item, tuple) else item

    return run


def _with_extra(metrics: MetricRecord | None, extra: dict[str, object]) -> MetricRecord | None:
    """The strategy's metrics plus the layers' numbers (one level of dicts flattened)."""
    flat: dict[str, float] = {}
    for name, value in extra.items():
        items = value.items() if isinstance(value, dict) else [("", value)]
        for sub, number in items:
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                flat[f"{name}.{sub}" if sub else name] = number
    if not flat:
        return metrics
    out = MetricRecord(dict(metrics or {}))
    out.update(flat)
    return out


def layered(strategy: Strategy, *layers: Layer) -> LayeredStrategy:
    """Wrap ``strategy`` so ``layers`` (instances of :class:`fedge.protocol.layer.Layer`, the same
    classes Fedge's engine runs) act on its train rounds; see the module docstring."""
    return LayeredStrategy(strategy, layers)
