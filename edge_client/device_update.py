"""The update a train body hands to the device's update mods (``compression_mod``, ``secure_mod``).

Two kinds of body make one, and the same mods send both:

* a user's ``@app.train()`` body returns its trained ``ArrayRecord`` as always; the mod takes the
  difference to the arrays the message brought (:class:`UserUpdate`, the floating-point arrays
  flattened in the record's order, of the layout the server described when it described one);
* Fedge's own handlers (``fedge.edge_client.algorithms``, a leaf's bridge, a plugin's handler built
  on ``edge_client.layers.upload``) already hold the flat delta, so they hand it over as it is
  (:func:`hand_off`, :class:`DeviceUpdate`): with its weight, the metrics, the node store namespace
  of its compression memory, the generator (the dither continues the handler's stream), when the
  message started, and the layout's tensor sizes. It rides beside the reply in this process, never
  serialized; a reply that skipped the mods carries no update, which the coordinator refuses.

Differential privacy's device clip (``dp-clip`` in the round's config) is applied here, once, to a
handed update: whichever mod sends it (masked or encoded) sends the bounded update.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fedge.protocol.config_keys import DP_CLIP, DP_FITTED
from fedge.protocol.layout import Layout, LayoutError
from fedge.protocol.records import (
    MEASURE_RECORD,
    METRICS_RECORD,
    MODEL_RECORD,
    UPDATE_RECORD,
    ProtocolError,
    flat_array,
    payload_record,
)
from fedge.protocol.round_config import RoundConfig

__all__ = ["DeviceUpdate", "UserUpdate", "hand_off", "handed", "take_update", "train_reply", "train_user_update"]


@dataclass
class DeviceUpdate:
    """A Fedge handler's update on its way to the update mods (:func:`hand_off`)."""

    delta: torch.Tensor  # flat float32
    examples: int
    weighted: bool  # False: its weight inside a masked sum is 1 (EASGD's center moves by the sum)
    memory: str  # the node store namespace of its compression memory
    generator: torch.Generator
    started: float  # time.perf_counter() when the message's handler began
    sizes: list[int]  # the model layout's tensor sizes (a codec's blocks)
    measure: torch.Tensor | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    model: torch.nn.Module | None = None  # the handler's trained model (EASGD's elastic step starts from it)
    others: RecordDict = field(default_factory=RecordDict)  # the handler's own records (SCAFFOLD's control change)
    # the node's (training, held-out) parts as the handler read them: a mod that measures on the
    # held-out part (EASGD's local-score) does not read the node's data again; None: not read
    parts: tuple[Any, Any] | None = None

    def bound(self, config: RoundConfig) -> None:
        """Differential privacy: clip to the round's ``dp-clip`` and report whether it fitted
        (adaptive clipping's bit, counted with noise by the coordinator)."""
        if DP_CLIP not in config.extra:
            return
        clip = config.number(DP_CLIP, low=0.0)
        norm = float(self.delta.norm())
        self.metrics[DP_FITTED] = 1.0 if norm <= clip else 0.0
        if norm > clip > 0:
            self.delta = self.delta * (clip / norm)

    def reply(self, msg: Message, payload: bytes, metrics: dict[str, Any]) -> Message:
        """The reply on the wire: the payload, ``metrics``, the measured model, the handler's own records."""
        reply = train_reply(msg, payload, metrics, self.started, measure=self.measure)
        for name, record in self.others.items():
            reply.content[name] = record
        return reply


#: the updates handed over and not yet taken, by the reply that carries them (same process)
_HANDED: weakref.WeakKeyDictionary[Message, DeviceUpdate] = weakref.WeakKeyDictionary()


def hand_off(msg: Message, update: DeviceUpdate) -> Message:
    """The handler's reply to ``msg``, carrying ``update`` to the update mods; the handler may add
    records of its own to it (they pass on). A mod that changed a handed update hands it on the same way."""
    reply = Message(update.others, reply_to=msg)
    _HANDED[reply] = update
    return reply


def handed(reply: Message) -> DeviceUpdate | None:
    """The update a Fedge handler handed over with ``reply``, taken (None: it carries none)."""
    update = _HANDED.pop(reply, None)
    if update is not None:
        update.others = reply.content
    return update


def train_reply(msg: Message, payload: bytes, metrics: dict[str, Any], started: float,
                measure: torch.Tensor | None = None) -> Message:
    """The reply of a train message: the payload (the only counted uplink), metrics, and
    optionally the exact local model for measurement."""
    content = RecordDict({
        UPDATE_RECORD: payload_record(payload),
        METRICS_RECORD: MetricRecord({**metrics, "payload-bytes": len(payload),
                                      "seconds": time.perf_counter() - started}),
    })
    if measure is not None:
        content[MEASURE_RECORD] = ArrayRecord({"model": flat_array(measure)})
    return Message(content, reply_to=msg)


@dataclass
class UserUpdate:
    """The update a user's ``@app.train()`` body made."""

    reply: Message  # the user's own reply (its records are the mod's to replace)
    layout: Layout
    received: ArrayRecord
    trained: ArrayRecord
    delta: torch.Tensor  # trained minus received, flat, float32


def take_update(msg: Message, context: Context, call_next: ClientAppCallable, purpose: str,
                digest: str | None = None, *, wrapped: bool = True) -> DeviceUpdate | UserUpdate | Message:
    """Run the body on ``msg``; the update it handed over (a Fedge handler's) or made (a user's),
    or its reply as it is when that is an error or, with ``wrapped`` False (the server asked the
    mod nothing), when no handler handed one over. ``purpose`` names the mod's use in errors
    ("compress", "mask"); ``digest``: the layout the server described. A wrapped message without
    the model, or of another layout, is refused before the body runs."""
    received = msg.content.array_records.get(MODEL_RECORD)
    if wrapped and received is None:
        raise LayoutError(f"a train message to {purpose} needs the model in its {MODEL_RECORD!r} ArrayRecord")
    layout = Layout(received) if wrapped and digest is not None else None  # checked before the body runs
    if layout is not None and layout.digest != digest:
        raise LayoutError(f"the model's layout {layout.digest} is not the one the server described ({digest})")
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    update = handed(reply)
    if update is not None or not wrapped or received is None:
        return update or reply  # a handler's flat update needs no layout of the message's model
    layout = layout if layout is not None else Layout(received)
    trained = reply.content.array_records.get(MODEL_RECORD)
    if trained is None:
        raise LayoutError(f"the train reply has no {MODEL_RECORD!r} ArrayRecord to {purpose}")
    delta = torch.from_numpy(layout.flatten(trained) - layout.flatten(received)).to(torch.float32)
    return UserUpdate(reply, layout, received, trained, delta)


def train_user_update(msg: Message, context: Context, call_next: ClientAppCallable, purpose: str) -> UserUpdate | Message:
    """:func:`take_update` for a mod that serves only a user's body (SCAFFOLD's, EASGD's)."""
    update = take_update(msg, context, call_next, purpose)
    if isinstance(update, DeviceUpdate):
        raise ProtocolError(f"a Fedge handler's update reached a user-app mod that cannot {purpose} it")
    return update
