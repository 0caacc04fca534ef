"""A node's side of the wrapper's lattice downlink: the model a message brings, as the ``ArrayRecord``
the user's ``@app.train()`` / ``@app.evaluate()`` code expects.

The change or snapshot is applied by the same code as Fedge's own devices
(``fedge.edge_client.downlink.lattice_copy``: base, copy and checks), the copy kept in the node's
``Context.state`` through a :class:`NodeStore`. What differs is only where the base and the layout
come from: a Flower app's node knows no task, so its base is zeros in the layout a snapshot
describes, or the start model the server names (``fedge.flower.start_model``), built from the app's
own code, or the base the server ships. A copy that does not match, a change from another version,
or no base raises :class:`OutOfSyncError` (:class:`MissingBaseError`) and the node answers with an
error, which makes the server send a snapshot and the base next time. The user's code never sees a
model that differs from the server's public copy.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedge.edge_client.downlink import held_support, lattice_copy
from fedge.edge_client.node_store import NodeStore
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
from fedge.protocol.records import DOWNLINK_RECORD, MODEL_RECORD, RAW_RECORD, ProtocolError
from fedge.protocol.refusals import OutOfSyncError

__all__ = ["receive_downlink"]

_NAMESPACE = "flower-downlink"  # this node's base, copy and layout, in Context.state


def receive_downlink(msg: Message, context: Context) -> np.ndarray:
    """Replace ``msg``'s lattice records by the model ``ArrayRecord`` they bring (in place); the
    coordinates the change moved (empty after a snapshot), which a ``tcs`` uplink sends on."""
    config = msg.content.config_records["config"]
    record = msg.content.array_records.get(DOWNLINK_RECORD)
    if record is None:
        raise ProtocolError(f"a lattice downlink message needs its {DOWNLINK_RECORD!r} ArrayRecord")
    store = NodeStore(context.state, _NAMESPACE)
    layout, start = _layout(config, store)

    def rebuild() -> torch.Tensor | None:  # the start model, or the zero base of the layout a snapshot sent
        if START_KEY in config:
            return torch.from_numpy(layout.flatten(start or build_start(str(config[START_KEY]))).copy())
        return torch.zeros(layout.numel) if LAYOUT_SPEC_KEY in config else None

    copy = lattice_copy(record, store, layout.sizes(), version=int(config[DOWNLINK_VERSION]),
                        digest=int(config[DOWNLINK_DIGEST]), base_digest=int(config[DOWNLINK_BASE_DIGEST]),
                        rebuild=rebuild, keep_support=True)
    raw = msg.content.array_records.get(RAW_RECORD, ArrayRecord())
    floats = {name for name, _, _ in layout.floats}  # rebuilt from the copy; the others travel in RAW_RECORD
    like = ArrayRecord({name: raw[name] if name in raw else Array(np.zeros(shape, dtype=dtype))
                        for name, shape, dtype in layout.entries if name not in floats})
    content = RecordDict({name: r for name, r in msg.content.items() if name not in (DOWNLINK_RECORD, RAW_RECORD)})
    content[MODEL_RECORD] = layout.rebuild(copy.numpy(), like)
    msg.content = content
    support = held_support(store)
    assert support is not None  # kept just now
    return support


def _layout(config: ConfigRecord, store: NodeStore) -> tuple[Layout, ArrayRecord | None]:
    """The model's layout (names, shapes, dtypes): the one this message describes, the one kept, or
    the named start model's (then also that model, the base to build); checked against the server's."""
    digest, start = str(config[LAYOUT_KEY]), None
    kept = str((store.get_meta("layout") or {}).get("spec", ""))
    if LAYOUT_SPEC_KEY in config:
        spec = str(config[LAYOUT_SPEC_KEY])
    elif kept and Layout.from_spec(kept).digest == digest:
        spec = kept
    elif START_KEY in config:
        start = build_start(str(config[START_KEY]))
        spec = Layout(start).spec
    else:
        raise OutOfSyncError("this node holds no base of the model's lattice, nor its layout; the server must "
                             "send a snapshot")
    layout = Layout.from_spec(spec)
    if layout.digest != digest:
        raise LayoutError(f"the model's layout here is {layout.digest}, the server described {digest}")
    store.put_meta("layout", {"spec": spec})
    return layout, start
