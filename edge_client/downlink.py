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
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from fedge.compression import make_codec
from fedge.compression.lattice import change_support, model_digest
from fedge.edge_client.node_store import NodeStore
from fedge.protocol import DOWNLINK_RECORD, MODEL_RECORD, PAYLOAD_KEY, payload_bytes, read_payload, read_state_dict
from fedge.protocol.downlink import LatticeCopy, apply_downlink, shipped_base
from fedge.protocol.config_keys import DOWNLINK_BASE_DIGEST, DOWNLINK_CODEC, DOWNLINK_DIGEST, DOWNLINK_VERSION
from fedge.protocol.refusals import MissingBaseError, OutOfSyncError
from fedge.protocol.round_config import RoundConfig
from fedge.tasks import Task, flatten_state, seeded_initial_params, tensor_sizes

__all__ = ["held_support", "lattice_copy", "received_model"]


def received_model(msg: Message, config: RoundConfig, store: NodeStore, task: Task,
                   model: torch.nn.Module | None = None) -> torch.Tensor:
    """The flat model to start from, as the coordinator holds it. ``model``: the handler's one model
    of this message (its layout; the full model is loaded into it); None: one is built here."""
    model = task.build_model() if model is None else model
    if config.extra.get(DOWNLINK_CODEC, "none") == "none" or MODEL_RECORD in msg.content.array_records:
        model.load_state_dict(read_state_dict(msg.content, MODEL_RECORD, model.state_dict()), strict=True)
        return flatten_state(model.state_dict())
    return _lattice_copy(msg, config, store, task, tensor_sizes(model.state_dict()))


def _lattice_copy(msg: Message, config: RoundConfig, store: NodeStore, task: Task, sizes: list[int]) -> torch.Tensor:
    read_payload(msg.content, DOWNLINK_RECORD)  # the record and its payload exist (checked in full below)

    def rebuild() -> torch.Tensor:
        rebuilt = seeded_initial_params(task, config.seed)
        if model_digest(rebuilt) != config.integer(DOWNLINK_BASE_DIGEST, 0):
            raise MissingBaseError("downlink base: this device's seeded initial model differs from the "
                                   "coordinator's (another torch build?); it must be sent once")
        return rebuilt

    return lattice_copy(msg.content.array_records[DOWNLINK_RECORD], store, sizes,
                        version=config.integer(DOWNLINK_VERSION, 0), digest=config.integer(DOWNLINK_DIGEST, 0),
                        base_digest=config.integer(DOWNLINK_BASE_DIGEST, 0), rebuild=rebuild,
                        keep_support=make_codec(config.codec).shares_support)


def lattice_copy(record: ArrayRecord, store: NodeStore, sizes: list[int], *, version: int, digest: int,
                 base_digest: int, rebuild: Callable[[], torch.Tensor | None],
                 keep_support: bool = False) -> torch.Tensor:
    """The flat copy of ``version`` a downlink ``record`` brings, applied to the copy ``store`` holds
    (and kept there): the one receiving end of Fedge's devices and of a Flower app's nodes
    (``fedge.flower.receive``). The base is the one shipped with ``record``, else the one stored
    (if it still has ``base_digest``), else ``rebuild()``'s: checked against ``base_digest``; None
    (nothing to build it from) raises :class:`OutOfSyncError`, so the coordinator ships it. With
    ``keep_support`` the coordinates the change moved are kept too (:func:`held_support`)."""
    numel = sum(sizes)
    base = _base(record, store, numel, base_digest, rebuild)
    meta, held, steps = store.get_meta("lattice.meta"), store.get_bytes("lattice.n"), store.get_tensor("lattice.steps")
    copy_held = None if meta is None or held is None or steps is None else LatticeCopy.decode(held, numel, steps)
    if copy_held is not None and copy_held.version != int(meta["version"]):  # type: ignore[index]
        copy_held = None  # the store's parts disagree: no copy to build on
    copy, updated = apply_downlink(record, sizes, base, copy_held, version=version, digest=digest)
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
