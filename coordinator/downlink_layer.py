"""The downlink, once for both coordinators: the model each message carries, in full fp32 or as the
versioned lattice change that brings its node's copy up to date.

FedAvg, FedBuff and EASGD (its center) in Fedge's engine, and any strategy wrapped by
``fedge.flower.compressed`` or ``fedge.flower.FedBuff`` in a user's ServerApp, send one model to
many nodes. A message whose :attr:`Outgoing.model` is set goes through :meth:`DownlinkLayer.outgoing`:
with ``none`` it carries the full model; with ``lattice:...`` the smallest message that brings its
node's copy to the current version (``fedge.aggregation.broadcast``): the change of one version, a
catch-up from the cache, or a snapshot. A step publishes a new version when its model changed or,
for a train step, when the nodes' copy still lags it by a lattice step (what earlier versions did not
carry goes out later: error feedback on the server). A reply confirms the version its node's message
brought; a failure forgets the node's copy (a ``needs-base`` refusal also ships the base next time),
except a reply's that arrived and was then dropped (stale, or an update that does not decode): that
device did apply its message. A message never answered forgets the copy too.

The two coordinators differ only in what the lattice's base is, which their adapters choose:

- Fedge's engine (built by ``fedge.server.engine.layers``, :meth:`DownlinkLayer.begin`): the task's
  seeded initial model, which every device builds, or a model file's weights, shipped once;
- a Flower app (:meth:`DownlinkLayer.for_app`): a zero base every node builds (version 0 is the
  start model on the lattice around it) or, with ``start=``, the start model each node builds from
  the constructor and seed named (``fedge.protocol.start_model``). Its nodes do not know the task:
  each message also names the layout's digest, a snapshot the layout itself (or the start model's
  name), and arrays that are not floating point travel as they are.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, MessageType, RecordDict

from fedge.aggregation.broadcast import (
    SENT_CATCH_UP,
    SENT_CURRENT,
    SENT_SNAPSHOT,
    DownlinkMessage,
    DownlinkSpec,
    VersionedBroadcast,
    parse_downlink,
)
from fedge.compression import Codec, SpecError, make_codec
from fedge.compression.lattice import model_digest
from fedge.protocol.config_keys import (
    DOWNLINK_CODEC,
    LAYOUT_KEY,
    LAYOUT_SPEC_KEY,
    START_KEY,
)
from fedge.protocol.downlink import DownlinkHeader, downlink_record
from fedge.protocol.failures import FailureKind
from fedge.coordinator.layer import MEMBERS, MODEL, Failure, Layer
from fedge.protocol.layout import Layout, LayoutError
from fedge.protocol.records import CONFIG_RECORD, DOWNLINK_RECORD, MODEL_RECORD, RAW_RECORD, array_bytes
from fedge.protocol.start_model import parse_start
from fedge.coordinator.step import Outgoing, Reply, Step, StepOutcome
from fedge.coordinator.tally import Tally

__all__ = ["DownlinkLayer", "uplink_codec", "uplink_refusal"]

log = logging.getLogger(__name__)

#: a copy that still lacks this share of the model's distance from its start, for this many versions
#: in a row past the warm-up, cannot follow the model: the run is told once, with the knobs
LAG_WARNING, LAG_VERSIONS = 0.9, 5


@dataclass
class _StepTally:
    """What one step's messages sent, by kind: a step's own object, never reset by hand."""

    messages: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    catch_up_sizes: list[tuple[int, int]] = field(default_factory=list)
    #: the full model's record, shared by the step's messages (``none``, Fedge's engine)
    full: tuple[torch.Tensor, ArrayRecord] | None = None

    def count(self, message: DownlinkMessage, size: int) -> None:
        """One message of ``size`` bytes (``array_bytes`` of its record: the one formula)."""
        self.messages[message.kind] += 1
        self.bytes[message.kind] += size
        if message.kind == SENT_CATCH_UP:
            self.catch_up_sizes.append((message.behind or 0, size))


class DownlinkLayer(Layer):
    """One run's downlink (see the module docstring). ``full_record`` builds the full model's record
    for ``none`` (Fedge's engine); without it the message keeps the record it has."""

    key = "downlink"
    provides = frozenset({MODEL})
    needs = frozenset({MEMBERS})  # encodes only the messages that go out: each one moves its node's copy

    def __init__(self, spec: str, *, track_supports: bool = False,
                 full_record: Callable[[torch.Tensor], ArrayRecord] | None = None) -> None:
        self.parsed: DownlinkSpec | None = parse_downlink(spec)  # ValueError with the reason
        self.track_supports = track_supports
        self.full_record = full_record
        self.broadcast: VersionedBroadcast | None = None
        self.sent: dict[int, int] = {}  # node -> the version its message in flight brings
        self.bytes = 0  # every downlink record sent, and the names a Flower app's snapshot carries
        self._ship_start = False  # the engine from a model file: the first message's model is the base
        self._app: tuple[str | None, Layout | None] | None = None  # a Flower app: (start model, layout)
        self._published: tuple[object, int] | None = None  # (step key, digest of the exact model)
        self._lagging = 0  # versions in a row whose copy lags by LAG_WARNING or more

    @classmethod
    def for_app(cls, spec: str, start: str | None = None, track_supports: bool = False) -> DownlinkLayer:
        """A Flower app's downlink: the base is zero, or the start model ``start`` names (each node
        builds it); an unknown spec or start is refused here, with the reason."""
        try:
            layer = cls(spec, track_supports=track_supports)
            if start is not None:
                parse_start(start)
        except ValueError as err:
            raise ValueError(f"downlink codec {spec!r}: {err}") from None
        layer._app = (start, None)
        return layer

    def begin(self, base: torch.Tensor, sizes: list[int], *, seeded: bool,
              start: torch.Tensor | None = None) -> None:
        """The lattice's ``base`` (``seeded``: every node builds it; else it is shipped once) and, for
        a zero base, the ``start`` model version 0 stands for."""
        if self.parsed is not None:
            self.broadcast = VersionedBroadcast(self.parsed, base, sizes, seeded=seeded, start=start,
                                                track_supports=self.track_supports)

    def ship_start(self) -> None:
        """A run from a model file: its weights, the model of the run's first message, are the base
        (shipped); a resumed run's base is its checkpoint's."""
        self._ship_start = True

    @property
    def spec(self) -> str:
        return "none" if self.parsed is None else self.parsed.spec

    @property
    def layout(self) -> Layout | None:
        """A Flower app's model layout, once its first model went out."""
        return None if self._app is None else self._app[1]

    @property
    def supports(self) -> dict[int, Any]:
        """node -> the coordinates its latest lattice message moved (``track_supports``)."""
        return {} if self.broadcast is None else self.broadcast.supports

    def bind(self, codec: Codec, node: int) -> Codec:
        """``codec`` bound to the support of the change ``node``'s latest message carried (``tcs``;
        any other codec as it is)."""
        return codec.with_support(self.supports.get(node)) if codec.shares_support else codec

    # -- a step ---------------------------------------------------------------------------------
    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        if self._ship_start and self.broadcast is not None:  # a model file's run: its first model is the base
            start = next((o.model for o in outgoing if o.model is not None), None)
            if start is not None:
                self.begin(start, self.broadcast.sizes, seeded=False)
                self._ship_start = False
        tally = self.scratch(step, _StepTally)
        for o in outgoing:
            if o.model is not None:
                self._ship(step, o, tally)

    def _ship(self, step: Step, o: Outgoing, tally: _StepTally) -> None:
        config = o.content.config_records[CONFIG_RECORD]
        arrays = o.content.array_records.get(MODEL_RECORD)
        if self.parsed is None:
            if self.full_record is None:  # a Flower app: the strategy's own arrays, counted
                self.bytes += array_bytes(o.content, (MODEL_RECORD,))
                return
            if tally.full is None or tally.full[0] is not o.model:
                tally.full = (o.model, self.full_record(o.model))
            config[DOWNLINK_CODEC] = "none"
            o.content[MODEL_RECORD] = tally.full[1]
            return
        layout = self._layout(o, arrays)
        train = o.message_type.split(".")[0] == MessageType.TRAIN  # train, or a named action (train.scaffold)
        b = self._publish((step.number, o.message_type), o.model, fresh=train)
        if o.node in self.sent:  # its last message was never answered: its copy is unknown
            self._forget(o.node)
        message = b.message_for(o.node)  # with track_supports, b.supports[node]: what it moves
        record = downlink_record(message.payload, message.steps, message.base)
        o.content.pop(MODEL_RECORD, None)
        o.content[DOWNLINK_RECORD] = record
        size = array_bytes(RecordDict({DOWNLINK_RECORD: record}))
        tally.count(message, size)
        self.bytes += size
        DownlinkHeader(self.spec, b.version, b.digest, b.base_digest).write(config)
        if layout is not None:  # a Flower app's node knows no task: the layout, what it builds, raw arrays
            config[LAYOUT_KEY] = layout.digest
            floats = {name for name, _, _ in layout.floats}
            raw = ArrayRecord({n: a for n, a in (arrays or {}).items() if n not in floats})
            if len(raw):
                o.content[RAW_RECORD] = raw
                self.bytes += array_bytes(o.content, (RAW_RECORD,))
            named = self._app[0] if self._app else None
            if named is not None and message.base is None and message.kind == SENT_SNAPSHOT:
                config[START_KEY] = named  # the constructor and seed a node builds the base with
                self.bytes += len(named.encode())
            elif message.base is not None or message.kind == SENT_SNAPSHOT:  # a zero or shipped base's layout
                config[LAYOUT_SPEC_KEY] = layout.spec
                self.bytes += len(layout.spec.encode())
        self.sent[o.node] = b.version

    def _layout(self, o: Outgoing, arrays: ArrayRecord | None) -> Layout | None:
        """A Flower app's model layout, and its broadcast made on the first model it sends."""
        if self._app is None:
            return None
        if arrays is None:
            raise LayoutError(f"a message with a model but no {MODEL_RECORD!r} record")
        named, layout = self._app
        if layout is None:
            layout = Layout(arrays)
            assert o.model is not None
            exact = o.model.detach().to(torch.float32)
            if named is not None:  # the base is the start model each node builds
                self.begin(exact, layout.sizes(), seeded=True)
            else:  # a zero base every node builds; version 0 is the start model on the lattice
                self.begin(torch.zeros(layout.numel), layout.sizes(), seeded=True, start=exact)
            self._app = (named, layout)
        elif Layout(arrays).digest != layout.digest:
            raise LayoutError("the strategy's model changed its layout during the run")
        return layout

    def _publish(self, key: object, params: torch.Tensor, fresh: bool) -> VersionedBroadcast:
        """Publish ``params`` as the next version, once per step (``key``), when it changed or, for a
        ``fresh`` (train) step, while the copy still lags it by a lattice step."""
        b = self.broadcast
        assert b is not None
        if self._published is None or self._published[0] != key:
            digest = model_digest(params)
            if self._published is None or digest != self._published[1] or (fresh and b.owes(params)):
                b.publish(params, b.version + 1)
                self._watch(b)
            self._published = (key, digest)
        return b

    def _watch(self, b: VersionedBroadcast) -> None:
        """Warn when the devices' copy cannot follow the model. Updates are computed on the copy, so
        a copy stuck near the start makes every round's update the start's, and the coordinator's
        model adds them up without bound (measured: a 1%, 4-bit lattice on NIID-Bench's CNN)."""
        past_warmup = b.version > b.spec.warmup
        self._lagging = self._lagging + 1 if past_warmup and b.lag >= LAG_WARNING else 0
        if self._lagging == LAG_VERSIONS:
            log.warning("downlink %s: the devices' copy of the model still lacks %.0f%% of the model's "
                        "distance from its start after %d versions in a row (%d coordinates clamped at "
                        "the bits limit in version %d); devices train on a model that is not the "
                        "coordinator's. A version moves at most `ratio` of the coordinates, each by at most "
                        "2^(bits-1)-1 steps of a tensor's initial RMS / resolution: raise ratio or bits, or "
                        "lower resolution", b.spec.spec, 100 * b.lag, LAG_VERSIONS, b.clamped, b.version)

    def arrived(self, step: Step, event: Reply | Failure) -> bool:
        """A reply: the node holds the copy its message brought. A failure: its copy is unknown (a
        snapshot next time), unless its reply arrived and only its update was refused."""
        if isinstance(event, Reply):
            version = self.sent.pop(event.node, None)
            if version is not None and self.broadcast is not None:
                self.broadcast.confirm(event.node, version)
            return False
        failure = event
        if failure.node is None:
            return False
        if failure.kind in (FailureKind.STALE, FailureKind.INVALID) and failure.node not in self.sent:
            return False  # its reply arrived (it confirmed the copy): a stale or undecodable update did apply its message
        # a node that cannot build the base says so (the engine's refusal; a Flower app's node errs)
        named = self._app is not None and self._app[0] is not None
        self._forget(failure.node, base=failure.kind == FailureKind.NEEDS_BASE or (named and failure.kind ==
                                                                        FailureKind.CLIENT_ERROR))
        return False

    def _forget(self, node: int, base: bool = False) -> None:
        self.sent.pop(node, None)
        if self.broadcast is not None:
            if base:
                log.warning("node %d cannot rebuild the downlink's base model; it will be sent in full", node)
            self.broadcast.forget(node, base=base)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        outcome.extra.update(self.metrics(self.scratch(step, _StepTally)))

    def metrics(self, tally: _StepTally) -> dict[str, Any]:
        """What one step sent, by kind (bytes include the steps and base arrays)."""
        if self.broadcast is None:
            return {}
        sizes = [size for _, size in tally.catch_up_sizes]
        out: dict[str, Any] = {
            "downlink_version": self.broadcast.version,
            "downlink_current": tally.messages[SENT_CURRENT], "downlink_current_bytes": tally.bytes[SENT_CURRENT],
            "downlink_catch_up": tally.messages[SENT_CATCH_UP], "downlink_catch_up_bytes": tally.bytes[SENT_CATCH_UP],
            "downlink_snapshot": tally.messages[SENT_SNAPSHOT], "downlink_snapshot_bytes": tally.bytes[SENT_SNAPSHOT],
            "downlink_catch_up_sizes": [[behind, size] for behind, size in tally.catch_up_sizes],
            "downlink_lag": round(self.broadcast.lag, 4), "downlink_clamped": self.broadcast.clamped,
        }
        if sizes:
            out["downlink_catch_up_median_bytes"] = statistics.median(sizes)
        return out

    # -- the run --------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"downlink_codec": self.spec}

    def state_dict(self) -> dict[str, Any]:
        return {} if self.broadcast is None else self.broadcast.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.broadcast is not None and state:
            self.broadcast.load_state_dict(state)
            self._ship_start = False


def uplink_refusal(codec: Codec, downlink: DownlinkLayer | None) -> str | None:
    """Why ``codec`` cannot encode the uplink beside ``downlink`` (None: it can), for both
    coordinators: a codec that sends on the coordinates the downlink's last change moved (``tcs``)
    has no such change without a lattice downlink."""
    if codec.shares_support and (downlink is None or downlink.parsed is None):
        return "sends on the coordinates the downlink's last change moved; it needs a lattice downlink"
    return None


def uplink_codec(spec: str, downlink: DownlinkLayer | None) -> Codec:
    """The uplink codec ``spec`` names, refused here with its reason when malformed, or when it sends
    on the coordinates the downlink's last change moved (``tcs``) and ``downlink`` is not a lattice."""
    try:
        codec = make_codec(spec)
    except (SpecError, ValueError) as err:
        raise ValueError(f"uplink codec {spec!r}: {err}") from None
    reason = uplink_refusal(codec, downlink)
    if reason is not None:
        raise ValueError(f"uplink codec {spec!r} {reason} (downlink=\"lattice:...\")")
    return codec
