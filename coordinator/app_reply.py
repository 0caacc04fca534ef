"""How a coordinator reads a Flower app's reply, in one place: its weight (``num-examples`` or the strategy's
``weighted_by_key``), its update (the uplink codec's payload, or, from an app that sends models, its
model minus the one sent) and the layers' part of the door around the decoding
(``LayerStack.through``, as Fedge's engine runs it); and the records a driver copies or merges on a
message's way to and from the user's strategy. Every Flower-app driver (``fedge.flower``'s
``layered`` and ``FedBuff``) takes a reply through the engine's door and accounting
(``fedge.coordinator.driver``) and :func:`reply_through_layers`, so what refuses a reply cannot
differ between them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedge.compression import Codec
from fedge.coordinator.layer import LayerStack
from fedge.protocol.layout import Layout, LayoutError
from fedge.protocol.records import FEDGE_REPLY_RECORDS, UPDATE_RECORD, ProtocolError, read_payload
from fedge.coordinator.step import Reply, Step, Update

__all__ = ["own_config", "reply_through_layers", "reply_update", "reply_weight", "with_extra", "with_raw"]


def reply_weight(reply: Message, key: str) -> tuple[float, MetricRecord]:
    """The reply's aggregation weight (``key`` of its metrics: finite and positive) and its metrics."""
    metrics = next(iter(reply.content.metric_records.values()), None)
    weight = None if metrics is None else metrics.get(key)
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not (math.isfinite(weight) and weight > 0):
        raise LayoutError(f"no positive {key!r} in the reply's metrics to weight it by")
    return float(weight), metrics  # type: ignore[return-value]


def reply_update(reply: Message, layout: Layout, wire: Codec | None, sent: np.ndarray | None, key: str,
                 payload: bytes | memoryview) -> tuple[torch.Tensor, float]:
    """A reply's update and weight, as every door of ``fedge.flower`` takes them: its ``payload`` (the
    update record's bytes, read once by the caller) decoded with ``wire`` (bound to its node's
    support), or its model minus ``sent`` (None: a payload is required). Raises what refuses the
    reply (``fedge.coordinator.door.REFUSES``), never a mis-decoded update."""
    weight, _ = reply_weight(reply, key)
    records = reply.content.array_records
    if UPDATE_RECORD in records or sent is None:
        if wire is None:
            raise LayoutError("a compressed update, but this strategy asked for none")
        if UPDATE_RECORD not in records:
            raise LayoutError(f"no {UPDATE_RECORD!r} record: is compression_mod on the ClientApp?")
        vector = wire.decode(payload, layout.numel)
    else:
        name = next((n for n in records if n not in FEDGE_REPLY_RECORDS), None)
        if name is None:
            raise ProtocolError("a train reply without its model's arrays")
        vector = torch.from_numpy(layout.flatten(records[name]) - sent)
    if not torch.isfinite(vector).all():
        raise ProtocolError("the reply's update holds NaN or infinite values")
    return vector, weight


def reply_through_layers(layers: LayerStack, step: Step, message: Message, reply: Reply, layout: Layout,
                         wire: Codec | None, sent: np.ndarray | None, key: str,
                         admit: Callable[[], None] = lambda: None) -> tuple[Update | None, Update | None]:
    """The layers' part of the door for a Flower-app driver (``layered``, ``FedBuff``), as Fedge's
    engine runs it (``LayerStack.through``): every layer sees the reply, then ``admit``
    (raises to refuse it before it is decoded: a stale update), :func:`reply_update` and every
    layer's ``update``. Returns (the update the layers made, the one decoded); (None, None) when a
    layer took the reply whole. Raises what refuses it (``fedge.coordinator.door.REFUSES``)."""
    metrics = dict(next(iter(message.content.metric_records.values()), MetricRecord()))
    payload = memoryview(read_payload(message.content, UPDATE_RECORD)
                         if UPDATE_RECORD in message.content.array_records else b"")
    decoded: list[Update] = []

    def decode() -> Update:
        admit()
        vector, weight = reply_update(message, layout, wire, sent, key, payload)
        decoded.append(Update(reply.node, vector.to(torch.float32), weight, metrics, bytes(payload), message.content,
                              started=reply.started))
        return decoded[0]

    update = layers.through(step, reply, payload, metrics, decode)
    return (None, None) if update is None else (update, decoded[0])


def own_config(message: Message) -> ConfigRecord:
    """The message's ``config`` record as its own copy, in its own RecordDict: Flower's strategies
    give every message of a round one RecordDict (and the caller's one ConfigRecord), and what is
    written for one node must not reach another."""
    content = RecordDict(dict(message.content.items()))
    config = content["config"] = ConfigRecord(dict(content.config_records.get("config", ConfigRecord())))
    message.content = content
    return config


def with_raw(like: ArrayRecord, raw: ArrayRecord) -> ArrayRecord:
    """``like`` with the arrays ``raw`` has (the integer buffers a node sends as they are)."""
    return ArrayRecord({name: raw[name] if name in raw else like[name] for name in like})


def with_extra(metrics: MetricRecord | None, extra: dict[str, object]) -> MetricRecord | None:
    """The strategy's metrics plus the layers' numbers (nested dicts flattened, ``a.b.c``)."""
    flat: dict[str, float] = {}

    def add(name: str, value: object) -> None:
        if isinstance(value, dict):
            for sub, item in value.items():
                add(f"{name}.{sub}", item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = value

    for name, value in extra.items():
        add(name, value)
    if not flat:
        return metrics
    out = MetricRecord(dict(metrics or {}))
    out.update(flat)
    return out
