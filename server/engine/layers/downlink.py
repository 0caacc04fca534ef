"""The model an algorithm sends, as Flower records: full fp32, or the versioned lattice downlink.

FedAvg, FedBuff and EASGD (its center) send one model to many devices. With ``downlink-codec =
"none"`` every device gets the full fp32 model. With ``lattice:...`` each gets the smallest message
that brings its copy to the current version (``fedge.aggregation.broadcast``): the change of one
version, a catch-up from the cache, or a snapshot. This module builds those records, records which
version each device holds once it replies (or forgets it when it fails) and counts the bytes of
each kind for the metrics row.

As a layer of the engine (``fedge.server.engine.layers``): a message whose :attr:`Outgoing.model`
is set gets that model, published as the step's version, in full or as a lattice change; a reply
that arrives confirms the version its message carried (an asynchronous reply: the version it
started from); a failure forgets the device's copy (a ``needs-base`` refusal also ships the base
next time), except a stale update's, which did apply its message. Algorithms know none of it.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, RecordDict

from fedge.aggregation.broadcast import (
    SENT_CATCH_UP,
    SENT_CURRENT,
    SENT_SNAPSHOT,
    DownlinkMessage,
    VersionedBroadcast,
    parse_downlink,
)
from fedge.compression import Codec
from fedge.protocol import CONFIG_RECORD, DOWNLINK_RECORD, MODEL_RECORD, array_bytes
from fedge.protocol.downlink import downlink_record
from fedge.protocol.config_keys import DOWNLINK_BASE_DIGEST, DOWNLINK_CODEC, DOWNLINK_DIGEST, DOWNLINK_VERSION
from fedge.protocol.failures import FailureKind
from fedge.protocol.refusals import NEEDS_BASE
from fedge.server.engine.algorithm import Algorithm, Outgoing, Reply, Step, StepOutcome
from fedge.protocol.layer import MODEL, Failure, Layer
from fedge.protocol.tally import Tally
from fedge.server.settings import SettingsError
from fedge.tasks import Task, flatten_state, seeded_initial_params, tensor_sizes, unflatten_state

__all__ = ["Downlink", "DownlinkLayer"]

log = logging.getLogger(__name__)


class Downlink:
    """One run's downlink. ``template``/``seed``/``init`` say what the lattice's base is."""

    def __init__(self, spec: str, task: Task, template: dict[str, torch.Tensor], seed: int, init: str,
                 track_supports: bool = False) -> None:
        self.parsed = parse_downlink(spec)
        self.template = template
        self.broadcast: VersionedBroadcast | None = None
        if self.parsed is not None:  # from a model file, the base is that model (set in start())
            base = flatten_state(template) if init else seeded_initial_params(task, seed)
            self.broadcast = VersionedBroadcast(self.parsed, base, tensor_sizes(template), seeded=not init,
                                                track_supports=track_supports)
        self._init = init

    @property
    def spec(self) -> str:
        return "none" if self.parsed is None else self.parsed.spec

    def start(self, params: torch.Tensor) -> None:
        """A run started from a model file: the lattice's base is that model (shipped to devices)."""
        if self.broadcast is not None and self._init:
            self.broadcast = VersionedBroadcast(self.broadcast.spec, params, tensor_sizes(self.template), seeded=False,
                                                track_supports=self.broadcast.track_supports)

    def config_keys(self) -> dict[str, Any]:
        """Keys every message of the current version carries in its config record."""
        if self.broadcast is None:
            return {DOWNLINK_CODEC: "none"}
        b = self.broadcast
        return {DOWNLINK_CODEC: self.spec, DOWNLINK_VERSION: b.version, DOWNLINK_DIGEST: b.digest,
                DOWNLINK_BASE_DIGEST: b.base_digest}

    def publish(self, params: torch.Tensor, version: int) -> None:
        """Make ``params`` the model of ``version`` (once per version; later calls for it do nothing)."""
        if self.broadcast is not None and self.broadcast.version < version:
            self.broadcast.publish(params, version)

    def model_record(self, params: torch.Tensor, node: int, tally: _StepTally) -> tuple[str, ArrayRecord]:
        """(record name, record) bringing ``node``'s copy to the current version: the full model
        (``arrays``, built once per step and model) or a lattice message (``downlink``), counted in
        ``tally``."""
        if self.broadcast is None:
            if tally.full is None or tally.full[0] is not params:
                tally.full = (params, ArrayRecord(unflatten_state(params, self.template)))
            return MODEL_RECORD, tally.full[1]
        message = self.broadcast.message_for(node)
        record = downlink_record(message.payload, message.steps, message.base)
        tally.count(message, array_bytes(RecordDict({DOWNLINK_RECORD: record})))
        return DOWNLINK_RECORD, record

    def replied(self, node: int, version: int) -> None:
        if self.broadcast is not None:
            self.broadcast.confirm(node, version)

    def failed(self, node: int, *, base: bool = False) -> None:
        if self.broadcast is not None:
            if base:
                log.warning("node %d cannot rebuild the downlink's base model; it will be sent in full", node)
            self.broadcast.forget(node, base=base)

    def metrics(self, tally: _StepTally) -> dict[str, Any]:
        """What one step sent, by kind (bytes include the steps and base arrays)."""
        if self.broadcast is None:
            return {}
        sizes = [size for _, size in tally.catch_up_sizes]
        out = {
            "downlink_version": self.broadcast.version,
            "downlink_current": tally.messages[SENT_CURRENT], "downlink_current_bytes": tally.bytes[SENT_CURRENT],
            "downlink_catch_up": tally.messages[SENT_CATCH_UP], "downlink_catch_up_bytes": tally.bytes[SENT_CATCH_UP],
            "downlink_snapshot": tally.messages[SENT_SNAPSHOT], "downlink_snapshot_bytes": tally.bytes[SENT_SNAPSHOT],
            "downlink_catch_up_sizes": [[behind, size] for behind, size in tally.catch_up_sizes],
        }
        if sizes:
            out["downlink_catch_up_median_bytes"] = statistics.median(sizes)
        return out

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {} if self.broadcast is None else self.broadcast.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.broadcast is not None and state:
            self.broadcast.load_state_dict(state)


@dataclass
class _StepTally:
    """What one step's messages sent, by kind: a step's own object, never reset by hand."""

    messages: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    catch_up_sizes: list[tuple[int, int]] = field(default_factory=list)
    #: the full model's record, shared by the step's messages (downlink-codec none)
    full: tuple[torch.Tensor, ArrayRecord] | None = None

    def count(self, message: DownlinkMessage, size: int) -> None:
        """One message of ``size`` bytes (``array_bytes`` of its record: the engine's one formula)."""
        self.messages[message.kind] += 1
        self.bytes[message.kind] += size
        if message.kind == SENT_CATCH_UP:
            self.catch_up_sizes.append((message.behind or 0, size))


class DownlinkLayer(Layer):
    key = "downlink"
    provides = frozenset({MODEL})

    def __init__(self, downlink: Downlink) -> None:
        self.downlink = downlink

    @classmethod
    def build(cls, algorithm: Algorithm, run_dir: object = None) -> DownlinkLayer:
        """Every run has one (``none`` ships full models); a malformed spec is refused here."""
        ctx, s = algorithm.ctx, algorithm.ctx.settings
        shares_support = ctx.codec.shares_support
        if shares_support and not s.downlink_codec.startswith("lattice"):
            raise SettingsError(f"codec {s.codec!r} sends on the coordinates the downlink's last change moved; it "
                                "needs a lattice downlink (downlink-codec = \"lattice:...\")")
        if shares_support and (algorithm.device_handler or algorithm.name) != "fedavg":
            raise SettingsError(f"codec {s.codec!r} sends on the support of the model change each device received; "
                                f"{algorithm.name}'s devices do not send an update from that model (FedAvg, FedProx "
                                "and FedBuff do)")
        try:
            return cls(Downlink(s.downlink_codec, ctx.task, ctx.template, s.seed, s.init, shares_support))
        except ValueError as err:
            raise SettingsError(f"downlink-codec: {err}") from None

    def bind(self, codec: Codec, node: int) -> Codec:
        """``codec`` bound to the support of the change ``node``'s latest message carried (``tcs``;
        any other codec as it is)."""
        if not codec.shares_support:
            return codec
        broadcast = self.downlink.broadcast
        return codec.with_support(None if broadcast is None else broadcast.supports.get(node))

    def start(self, params: torch.Tensor) -> None:
        """A fresh run from ``params`` (a model file's: the lattice's base)."""
        self.downlink.start(params)

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        tally = self.scratch(step, _StepTally)
        for o in outgoing:
            if o.model is None:
                continue
            self.downlink.publish(o.model, step.number)  # once per version
            config = o.content.config_records[CONFIG_RECORD]
            for key, value in self.downlink.config_keys().items():
                config[key] = value
            name, record = self.downlink.model_record(o.model, o.node, tally)
            o.content[name] = record

    def arrived(self, step: Step, reply: Reply, payload: memoryview, metrics: dict[str, float]) -> bool:
        """The node holds the copy its message brought (asynchronous: the version it started from)."""
        self.downlink.replied(reply.node, step.number if reply.started is None else reply.started + 1)
        return False

    def missed(self, step: Step, failure: Failure) -> None:
        if failure.node is not None and failure.kind != FailureKind.STALE:  # a stale update did apply its message
            self.downlink.failed(failure.node, base=failure.kind == NEEDS_BASE)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        outcome.extra.update(self.downlink.metrics(self.scratch(step, _StepTally)))

    def describe(self) -> dict[str, Any]:
        return {"downlink_codec": self.downlink.spec}

    def state_dict(self) -> dict[str, Any]:
        return self.downlink.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.downlink.load_state_dict(state or {})
