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

One receiving end, :func:`receive_downlink`, which ``compression_mod`` calls before the handler (a
Fedge ClientApp's) or the user's code (a Flower app's) runs: either gets the model in its
``arrays`` record as if it had come in full. A Fedge message names its task, whose seeded initial
model is the base. A Flower app's node knows no task, so
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

from fedge.compression.lattice import change_support, model_digest
from fedge.edge_client.node_store import NodeStore
from fedge.protocol import DOWNLINK_RECORD, MODEL_RECORD, PAYLOAD_KEY, payload_bytes
from fedge.protocol.config_keys import LAYOUT_KEY, LAYOUT_SPEC_KEY, START_KEY
from fedge.protocol.downlink import DownlinkHeader, LatticeCopy, apply_downlink, shipped_base
from fedge.protocol.layout import Layout, LayoutError
from fedge.protocol.records import RAW_RECORD, ProtocolError
from fedge.protocol.refusals import MissingBaseError, OutOfSyncError
from fedge.protocol.round_config import RoundConfig
from fedge.protocol.start_model import build_start
from fedge.edge_client import local
from fedge.tasks import flatten_state, seeded_initial_model, seeded_initial_params

__all__ = ["DOWNLINK_NAMESPACE", "held_support", "lattice_copy", "receive_downlink"]


#: the node store namespace of a Fedge device's lattice copy
DOWNLINK_NAMESPACE = "downlink"


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


_FLOWER_NAMESPACE = "flower-downlink"  # a Flower app's node: its base, copy and layout, in Context.state


def receive_downlink(msg: Message, context: Context, header: DownlinkHeader) -> np.ndarray:
    """Replace ``msg``'s lattice records (``header``: what its config says of them) by the model
    ``ArrayRecord`` they bring (in place), so the handler or the user's code gets a model as
    always; the coordinates the change moved (empty after a snapshot), which a ``tcs`` uplink
    sends on. The one receiving end of Fedge's devices and a Flower app's nodes: a Fedge message
    names its task (the base is the task's seeded initial model, the layout the task model's), a
    Flower app's names the layout (``fedge.layout``) and its base (a start model, or zeros)."""
    config = msg.content.config_records["config"]
    record = msg.content.array_records.get(DOWNLINK_RECORD)
    if record is None:
        raise ProtocolError(f"a lattice downlink message needs its {DOWNLINK_RECORD!r} ArrayRecord")
    if LAYOUT_KEY in config:  # a Flower app's node
        store = NodeStore(context.state, _FLOWER_NAMESPACE)
        layout, rebuild = _app_layout(config, store)
    else:  # Fedge's own device: the round's task
        store = NodeStore(context.state, DOWNLINK_NAMESPACE)
        layout, rebuild = _task_layout(RoundConfig.from_record(config), store)
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


def _task_layout(config: RoundConfig, store: NodeStore) -> tuple[Layout, Callable[[], torch.Tensor | None]]:
    """The task model's layout (kept after the first message, so no model is built for it again)
    and its base: the task's seeded initial model (checked against the coordinator's digest)."""
    task = local.task_of(config)
    kept = store.get_meta("layout") or {}
    if kept.get("task") == config.task:
        layout = Layout.from_spec(str(kept["spec"]))
        return layout, lambda: seeded_initial_params(task, config.seed)
    model = seeded_initial_model(task, config.seed)  # one build: the layout, and the base if it is needed
    layout = Layout(ArrayRecord(model.state_dict()))
    store.put_meta("layout", {"task": config.task, "spec": layout.spec})
    return layout, lambda: flatten_state(model.state_dict())


def _app_layout(config: ConfigRecord, store: NodeStore) -> tuple[Layout, Callable[[], torch.Tensor | None]]:
    """A Flower app's model layout (names, shapes, dtypes): the one this message describes, the one
    kept, or the named start model's; checked against the server's. The base: the start model the
    server names, or the zero base of the layout a snapshot sent (None: nothing to build it from)."""
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

    def rebuild() -> torch.Tensor | None:
        if START_KEY in config:
            return torch.from_numpy(layout.flatten(start or build_start(str(config[START_KEY]))).copy())
        return torch.zeros(layout.numel) if LAYOUT_SPEC_KEY in config else None

    return layout, rebuild
