"""The model a train message brings: full fp32, or the device's versioned lattice copy brought up to date.

With a lattice downlink (``fedge.aggregation.broadcast``) the device keeps ``n``, the integer
coordinates of its copy ``base + step * n``, and the version they belong to, in its node store
(compactly: the encoded snapshot, a few bits per coordinate). A message brings a change from the
version the coordinator believes the device holds, or a snapshot. The device applies it, rebuilds the
copy, and checks it against the digest the coordinator sent before training. Anything that does not
fit (another version, no copy, a digest mismatch, a base it cannot rebuild) raises
:class:`OutOfSyncError` (:class:`MissingBaseError` for the base): the device replies with a typed
refusal (``edge_client.layers.refusal_mod``), the coordinator forgets the device's copy and sends a
snapshot (and the base) next time, and no training ever starts from a copy that differs from the
coordinator's.

The same receiving end serves a Flower app's node (:func:`receive_downlink`, which
``fedge.flower.compression_mod`` calls before the user's code): there the node knows no task, so
its base is zeros in the layout a snapshot describes, or the start model the server names
(``fedge.protocol.start_model``), built from the app's own code, or the base the server ships; the
copy is kept in the node's ``Context.state``. A copy that does not match, a change from another
version, or no base raises :class:`OutOfSyncError` (:class:`MissingBaseError`) and the node answers
with an error, which makes the server send a snapshot and the base next time. The user's code never
sees a model that differs from the server's public copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedge.compression import make_codec
from fedge.compression.lattice import change_support, model_digest
from fedge.edge_client.node_store import NodeStore
from fedge.protocol import DOWNLINK_RECORD, MODEL_RECORD, PAYLOAD_KEY, payload_bytes, read_payload, read_state_dict
from fedge.protocol.config_keys import LAYOUT_KEY, LAYOUT_SPEC_KEY, START_KEY
from fedge.protocol.downlink import DownlinkHeader, LatticeCopy, apply_downlink, shipped_base
from fedge.protocol.layout import Layout, LayoutError
from fedge.protocol.records import RAW_RECORD, ProtocolError
from fedge.protocol.refusals import MissingBaseError, OutOfSyncError
from fedge.protocol.round_config import RoundConfig
from fedge.protocol.start_model import build_start
from fedge.tasks import Task, flatten_state, seeded_initial_params, tensor_sizes

__all__ = ["held_support", "lattice_copy", "receive_downlink", "received_model"]


def received_model(msg: Message, config: RoundConfig, store: NodeStore, task: Task,
                   model: torch.nn.Module | None = None) -> torch.Tensor:
    """The flat model to start from, as the coordinator holds it. ``model``: the handler's one model
    of this message (its layout; the full model is loaded into it); None: one is built here."""
    model = task.build_model() if model is None else model
    header = DownlinkHeader.read(config.extra)
    if header is None or MODEL_RECORD in msg.content.array_records:
        model.load_state_dict(read_state_dict(msg.content, MODEL_RECORD, model.state_dict()), strict=True)
        return flatten_state(model.state_dict())
    read_payload(msg.content, DOWNLINK_RECORD)  # the record and its payload exist (checked in full below)

    def rebuild() -> torch.Tensor:
        rebuilt = seeded_initial_params(task, config.seed)
        if model_digest(rebuilt) != header.base_digest:
            raise MissingBaseError("downlink base: this device's seeded initial model differs from the "
                                   "coordinator's (another torch build?); it must be sent once")
        return rebuilt

    sizes = tensor_sizes(model.state_dict())
    return lattice_copy(msg.content.array_records[DOWNLINK_RECORD], store, sizes, header, rebuild=rebuild,
                        keep_support=make_codec(config.codec).shares_support)


def lattice_copy(record: ArrayRecord, store: NodeStore, sizes: list[int], header: DownlinkHeader, *,
                 rebuild: Callable[[], torch.Tensor | None], keep_support: bool = False) -> torch.Tensor:
    """The flat copy of the version a downlink ``record`` and its ``header`` bring, applied to the
    copy ``store`` holds (and kept there): the one receiving end of Fedge's devices and of a Flower
    app's nodes (``fedge.edge_client.downlink``). The base is the one shipped with ``record``, else
    the one stored (if it still has the header's base digest), else ``rebuild()``'s: checked against
    it; None (nothing to build it from) raises :class:`OutOfSyncError`, so the coordinator ships it.
    With ``keep_support`` the coordinates the change moved are kept too (:func:`held_support`)."""
    numel = sum(sizes)
    base = _base(record, store, numel, header.base_digest, rebuild)
    meta, held, steps = store.get_meta("lattice.meta"), store.get_bytes("lattice.n"), store.get_tensor("lattice.steps")
    copy_held = None if meta is None or held is None or steps is None else LatticeCopy.decode(held, numel, steps)
    if copy_held is not None and copy_held.version != int(meta["version"]):  # type: ignore[index]
        copy_held = None  # the store's parts disagree: no copy to build on
    copy, updated = apply_downlink(record, sizes, base, copy_held, version=header.version,
                                   digest=header.digest)
    # Stored compactly (the snapshot encoding); the digest check passed, so this is the copy.
    store.put_bytes("lattice.n", updated.encode())
    store.put_tensor("lattice.steps", updated.tensor_steps)
    store.put_meta("lattice.meta", {"version": updated.version})
    if keep_support:  # the coordinates this change moved (none after a snapshot): a tcs uplink sends on them
        support = change_support(payload_bytes(record[PAYLOAD_KEY], f"downlink[{PAYLOAD_KEY}]"), numel)
        store.put_bytes("lattice.support", np.asarray(support, dtype=np.int64).tobytes())
    return copy


def held_support(store: NodeStore) -> np.ndarray | None:
    """The coordinates the last downlink change this device applied moved (kept by
    :func:`lattice_copy` with ``keep_support``), or None when it kept none."""
    data = store.get_bytes("lattice.support")
    return None if data is None else np.frombuffer(data, dtype=np.int64).copy()


def _base(record: ArrayRecord, store: NodeStore, numel: int, expected: int,
          rebuild: Callable[[], torch.Tensor | None]) -> torch.Tensor:
    """The lattice's base: shipped with this message, shipped or rebuilt earlier and stored, or
    rebuilt here and checked against the coordinator's digest (then stored: later messages need not
    build the model again)."""
    shipped = shipped_base(record, numel, expected)
    if shipped is not None:
        store.put_tensor("lattice.base", shipped)
        return shipped
    stored = store.get_tensor("lattice.base")
    if stored is not None and stored.numel() == numel and model_digest(stored) == expected:
        return stored
    rebuilt = rebuild()
    if rebuilt is None:
        raise OutOfSyncError("this node holds no base of the model's lattice; the coordinator must send it")
    if rebuilt.numel() != numel or model_digest(rebuilt) != expected:
        raise MissingBaseError("the downlink base built here differs from the coordinator's; it must be sent once")
    store.put_tensor("lattice.base", rebuilt)
    return rebuilt


# -- a Flower app's node (``fedge.flower.compressed(..., downlink="lattice:...")``) ------------------
_NAMESPACE = "flower-downlink"  # this node's base, copy and layout, in Context.state


def receive_downlink(msg: Message, context: Context, header: DownlinkHeader) -> np.ndarray:
    """Replace ``msg``'s lattice records (``header``: what its config says of them) by the model
    ``ArrayRecord`` they bring (in place); the coordinates the change moved (empty after a
    snapshot), which a ``tcs`` uplink sends on."""
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

    copy = lattice_copy(record, store, layout.sizes(), header, rebuild=rebuild, keep_support=True)
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
