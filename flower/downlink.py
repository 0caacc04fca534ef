"""The wrapper's downlink: every node's copy of the model as a versioned lattice, not the fp32 arrays.

With ``compressed(strategy, downlink="lattice:...")`` the messages the wrapped strategy builds lose
their model ``ArrayRecord``; each gets instead the smallest lattice message that brings that node's
copy to the current version (``fedge.aggregation.broadcast``, the same coordinator side as Fedge's
own engine): the change of one version, a catch-up over the versions it missed, or a snapshot.
The lattice's base is zero, which every node builds (a Flower app's nodes cannot rebuild the
server's start model), with per-tensor steps from the start model's scale; a snapshot carries the
model's names, shapes and dtypes (JSON, counted) so the node can. With ``start=`` naming the
constructor and seed the ServerApp built its start model with (``fedge.protocol.start_model``), the
base is that model, which each node builds itself: no model goes out whole at all, except once, in
fp32, to a node that could not build it. Arrays that are not floating point (integer buffers)
travel as they are, every time.

The nodes hold the public copy, not the exact model: their updates (from that copy) move the
wrapped strategy's exact model, and what a version did not carry stays in the difference between
the two and goes out in a later one (error feedback on the server). A node that replies holds the
version its message brought; one that fails or does not reply is forgotten and gets a snapshot
next time. With ``track_supports`` (a ``tcs`` uplink, which sends on them) the coordinates each
node's message moved are kept (:attr:`ServerDownlink.supports`, the broadcast's).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from fedge.aggregation.broadcast import SENT_SNAPSHOT, DownlinkSpec, VersionedBroadcast, parse_downlink
from fedge.compression.lattice import model_digest
from fedge.protocol.layout import Layout, LayoutError
from fedge.flower.messages import own_config
from fedge.protocol.start_model import parse_start
from fedge.protocol.config_keys import (
    DOWNLINK_BASE_DIGEST,
    DOWNLINK_CODEC,
    DOWNLINK_DIGEST,
    DOWNLINK_VERSION,
    LAYOUT_KEY,
    LAYOUT_SPEC_KEY,
    START_KEY,
)
from fedge.protocol.downlink import downlink_record
from fedge.protocol.records import DOWNLINK_RECORD, MODEL_RECORD, RAW_RECORD, array_bytes

__all__ = ["ServerDownlink"]


class ServerDownlink:
    """One wrapped strategy's downlink (``spec`` ``none``: the wrapped strategy's own fp32 arrays)."""

    def __init__(self, spec: str, start: str | None = None, track_supports: bool = False) -> None:
        try:
            self.parsed: DownlinkSpec | None = parse_downlink(spec)
            if start is not None:
                parse_start(start)
        except ValueError as err:
            raise ValueError(f"downlink codec {spec!r}: {err}") from None
        self.start = start  # the nodes build the start model themselves: it is the lattice's base
        self.broadcast: VersionedBroadcast | None = None
        self.layout: Layout | None = None
        self.published: int | None = None  # digest of the exact model last published
        self.sent: dict[int, int] = {}  # node -> version its latest message brought
        self.track_supports = track_supports
        self.bytes = 0  # downlink records sent (model, lattice, base and raw arrays), as Flower serializes them

    @property
    def supports(self) -> dict[int, np.ndarray]:
        """node -> the coordinates its latest lattice message moved (``track_supports``)."""
        return {} if self.broadcast is None else self.broadcast.supports

    @property
    def spec(self) -> str:
        return "none" if self.parsed is None else self.parsed.spec

    def public(self, arrays: ArrayRecord, fresh: bool = False) -> np.ndarray | None:
        """Publish ``arrays`` as the next version when they changed or, for a ``fresh`` round (a
        train round), while the nodes' copy still differs from them by a lattice step: what earlier
        versions did not carry goes out even in a round after which the model did not move. The flat
        copy the nodes will hold (None without a lattice: they get ``arrays`` themselves)."""
        if self.parsed is None:
            return None
        layout = Layout(arrays)
        exact = torch.from_numpy(layout.flatten(arrays).copy())
        if self.broadcast is None and self.start is not None:  # the base is the start model each node builds
            self.layout = layout
            self.broadcast = VersionedBroadcast(self.parsed, exact, layout.sizes(), seeded=True,
                                                track_supports=self.track_supports)
        elif self.broadcast is None:  # a zero base every node builds; version 0 is the start model on the lattice
            self.layout = layout
            self.broadcast = VersionedBroadcast(self.parsed, torch.zeros(layout.numel), layout.sizes(), seeded=True,
                                                track_supports=self.track_supports,
                                                start=exact)
        elif layout.digest != self.layout.digest:  # type: ignore[union-attr]
            raise LayoutError("the strategy's model changed its layout during the run")
        digest = model_digest(exact)
        if digest != self.published or (fresh and self.broadcast.owes(exact)):
            self.broadcast.publish(exact, self.broadcast.version + 1)
            self.published = digest
        return self.broadcast.public.numpy().copy()

    def attach(self, messages: Iterable[Message], arrays: ArrayRecord) -> list[Message]:
        """Each message with its own ``config`` copy (:func:`own_config`) and its node's lattice
        message in place of the model (counted)."""
        messages = list(messages)
        configs = [own_config(m) for m in messages]
        if self.broadcast is None or self.layout is None:
            self.bytes += sum(array_bytes(m.content, (MODEL_RECORD,)) for m in messages)
            return messages
        b, floats = self.broadcast, {name for name, _, _ in self.layout.floats}
        raw = ArrayRecord({name: array for name, array in arrays.items() if name not in floats})
        for message, config in zip(messages, configs, strict=True):
            node = message.metadata.dst_node_id
            lattice = b.message_for(node)  # with track_supports, b.supports[node]: what it moves
            content = message.content  # its own RecordDict (own_config)
            if MODEL_RECORD in content:
                del content[MODEL_RECORD]
            # the engine's record; a node that could not build the named start model gets the base in it
            content[DOWNLINK_RECORD] = downlink_record(lattice.payload, lattice.steps, lattice.base)
            if len(raw):
                content[RAW_RECORD] = raw
            config[DOWNLINK_CODEC], config[LAYOUT_KEY] = self.spec, self.layout.digest
            config[DOWNLINK_VERSION], config[DOWNLINK_DIGEST] = int(b.version), int(b.digest)
            config[DOWNLINK_BASE_DIGEST] = int(b.base_digest)
            if self.start is not None and lattice.base is None and lattice.kind == SENT_SNAPSHOT:
                config[START_KEY] = self.start  # the constructor and seed a node builds the base with
                self.bytes += len(self.start.encode())
            elif lattice.base is not None or lattice.kind == SENT_SNAPSHOT:  # the layout of a zero or shipped base
                config[LAYOUT_SPEC_KEY] = self.layout.spec
                self.bytes += len(self.layout.spec.encode())
            self.sent[node] = b.version
            self.bytes += array_bytes(content, (DOWNLINK_RECORD, RAW_RECORD))
        return messages

    def settle(self, replies: list[Message]) -> None:
        """Who holds what after a round's replies: a reply confirms the version its message brought;
        an error, or no reply at all, forgets the node's copy (it gets a snapshot, with the layout
        it builds the zero base from)."""
        if self.broadcast is None:
            return
        answered = set()
        for reply in replies:
            answered.add(reply.metadata.src_node_id)
            self.settle_reply(reply)
        for node in [n for n in self.sent if n not in answered]:
            self.lost(node)

    def settle_reply(self, reply: Message) -> None:
        """One reply, as it arrives (asynchronous strategies: the other nodes are still training)."""
        if self.broadcast is None:
            return
        node = reply.metadata.src_node_id
        version = self.sent.pop(node, None)
        if reply.has_error() or version is None:  # with a named start model: ship it once
            self.broadcast.forget(node, base=self.start is not None and reply.has_error())
        else:
            self.broadcast.confirm(node, version)

    def lost(self, node: int) -> None:
        """A node whose reply never came: its copy is unknown, so it gets a snapshot next time."""
        self.sent.pop(node, None)
        if self.broadcast is not None:
            self.broadcast.forget(node)
