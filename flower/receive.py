"""A node's side of the wrapper's lattice downlink: the model a message brings, as the ``ArrayRecord``
the user's ``@app.train()`` / ``@app.evaluate()`` code expects.

The node keeps, in its ``Context.state``, the lattice's base (zeros in the model's layout, built
from the names, shapes and dtypes a snapshot carries, or shipped) and its lattice copy (version,
integer coordinates, steps). A
message's change or snapshot is applied by ``fedge.protocol.downlink`` (the same code as Fedge's own
ClientApp) and checked against the digest the server sent; a copy that does not match, a change
from another version, or no base raises :class:`OutOfSyncError` and the node answers with an
error, which makes the server send a snapshot and the base next time. The user's code never sees
a model that differs from the server's public copy.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedge.compression.lattice import change_support, model_digest
from fedge.flower.layout import Layout, LayoutError
from fedge.flower.start_model import build_start
from fedge.protocol.config_keys import (
    DOWNLINK_BASE_DIGEST,
    DOWNLINK_DIGEST,
    DOWNLINK_VERSION,
    LAYOUT_KEY,
    LAYOUT_SPEC_KEY,
    START_KEY,
)
from fedge.protocol.downlink import LatticeCopy, apply_downlink
from fedge.protocol.records import (
    BASE_RECORD,
    DOWNLINK_RECORD,
    MODEL_RECORD,
    PAYLOAD_KEY,
    RAW_RECORD,
    ProtocolError,
    payload_bytes,
)
from fedge.protocol.refusals import MissingBaseError, OutOfSyncError

__all__ = ["receive_downlink"]

_BASE = "fedge.flower.base"  # Context.state: the base model's arrays
_BASE_META = "fedge.flower.base-meta"  # and the digest they were checked against
_COPY = "fedge.flower.copy"  # Context.state: the lattice copy (n encoded, steps)
_COPY_META = "fedge.flower.copy-meta"


def receive_downlink(msg: Message, context: Context) -> np.ndarray:
    """Replace ``msg``'s lattice records by the model ``ArrayRecord`` they bring (in place); the
    coordinates the change moved (empty after a snapshot), which a ``tcs`` uplink sends on."""
    config = msg.content.config_records["config"]
    record = msg.content.array_records.get(DOWNLINK_RECORD)
    if record is None:
        raise ProtocolError(f"a lattice downlink message needs its {DOWNLINK_RECORD!r} ArrayRecord")
    base_record = _base(msg, context, str(config[LAYOUT_KEY]), int(config[DOWNLINK_BASE_DIGEST]))
    layout = Layout(base_record)
    copy, updated = apply_downlink(record, layout.sizes(), torch.from_numpy(layout.flatten(base_record).copy()),
                                   _held(context, layout), version=int(config[DOWNLINK_VERSION]),
                                   digest=int(config[DOWNLINK_DIGEST]))
    context.state[_COPY] = ArrayRecord({"n": Array(np.frombuffer(updated.encode(), dtype=np.uint8).copy()),
                                        "steps": Array(updated.tensor_steps.numpy().copy())})
    context.state[_COPY_META] = ConfigRecord({"layout": layout.digest})
    raw = msg.content.array_records.get(RAW_RECORD, ArrayRecord())
    like = ArrayRecord({name: raw[name] if name in raw else base_record[name] for name in base_record})
    content = RecordDict({name: r for name, r in msg.content.items() if name not in (DOWNLINK_RECORD, BASE_RECORD,
                                                                                      RAW_RECORD)})
    content[MODEL_RECORD] = layout.rebuild(copy.numpy(), like)
    msg.content = content
    return change_support(payload_bytes(record[PAYLOAD_KEY], f"downlink[{PAYLOAD_KEY}]"), layout.numel)


def _base(msg: Message, context: Context, layout_digest: str, digest: int) -> ArrayRecord:
    """The base shipped with this message, kept from an earlier one (its digest was checked when it
    was kept, and is not computed again), or built here from the start model or the layout."""
    shipped = msg.content.array_records.get(BASE_RECORD)
    if shipped is not None:
        if Layout(shipped).digest != layout_digest:
            raise LayoutError(f"the shipped base has layout {Layout(shipped).digest}, the server described "
                              f"{layout_digest}")
        if not _fits(shipped, layout_digest, digest):
            raise ProtocolError("the shipped downlink base does not match its digest")
        return _keep(context, ArrayRecord({name: array for name, array in shipped.items()}), digest)
    kept, meta = context.state.array_records.get(_BASE), context.state.config_records.get(_BASE_META)
    if kept is not None and meta is not None and meta.get("digest") == digest and Layout(kept).digest == layout_digest:
        return kept
    config = msg.content.config_records["config"]
    if START_KEY in config:  # the start model, built from the app's own code and the server's seed
        start = build_start(str(config[START_KEY]))
        if _fits(start, layout_digest, digest):
            return _keep(context, start, digest)
        raise MissingBaseError(f"the start model {config[START_KEY]} built here differs from the server's; "
                               "it must be sent once")
    if LAYOUT_SPEC_KEY in config:  # a snapshot: build the zero base in the layout it describes
        zeros = Layout.zeros(str(config[LAYOUT_SPEC_KEY]))
        if _fits(zeros, layout_digest, digest):
            return _keep(context, zeros, digest)
    raise OutOfSyncError("this node holds no base of the model's lattice; the server must send it")


def _fits(record: ArrayRecord, layout_digest: str, digest: int) -> bool:
    """Whether ``record`` has the server's layout and, flattened, the server's digest."""
    layout = Layout(record)
    return layout.digest == layout_digest and model_digest(torch.from_numpy(layout.flatten(record).copy())) == digest


def _keep(context: Context, base: ArrayRecord, digest: int) -> ArrayRecord:
    context.state[_BASE] = base
    context.state[_BASE_META] = ConfigRecord({"digest": int(digest)})
    return base


def _held(context: Context, layout: Layout) -> LatticeCopy | None:
    record, meta = context.state.array_records.get(_COPY), context.state.config_records.get(_COPY_META)
    if record is None or meta is None or meta.get("layout") != layout.digest:
        return None
    steps = torch.from_numpy(np.array(record["steps"].numpy(), dtype=np.float32, copy=True))
    return LatticeCopy.decode(bytes(record["n"].numpy().tobytes()), layout.numel, steps)
