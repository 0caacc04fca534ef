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

import torch
from flwr.app import Message

from fedge.aggregation.broadcast import lattice_model, model_digest
from fedge.compression.lattice import CHANGE, SNAPSHOT, decode_lattice, encode_lattice, lattice_header
from fedge.edge_client.node_store import NodeStore
from fedge.protocol import (
    DOWNLINK_BASE_KEY,
    DOWNLINK_RECORD,
    DOWNLINK_STEPS_KEY,
    MODEL_RECORD,
    ProtocolError,
    read_flat,
    read_payload,
    read_state_dict,
)
from fedge.protocol.config_keys import DOWNLINK_BASE_DIGEST, DOWNLINK_CODEC, DOWNLINK_DIGEST, DOWNLINK_VERSION
from fedge.protocol.refusals import MissingBaseError, OutOfSyncError
from fedge.protocol.round_config import RoundConfig
from fedge.tasks import Task, flatten_state, seeded_initial_params, tensor_sizes

__all__ = ["received_model"]


def received_model(msg: Message, config: RoundConfig, store: NodeStore, task: Task) -> torch.Tensor:
    """The flat model to start from, as the coordinator holds it."""
    if config.extra.get(DOWNLINK_CODEC, "none") == "none" or MODEL_RECORD in msg.content.array_records:
        model = task.build_model()
        model.load_state_dict(read_state_dict(msg.content, MODEL_RECORD, model.state_dict()), strict=True)
        return flatten_state(model.state_dict())
    return _lattice_copy(msg, config, store, task)


def _lattice_copy(msg: Message, config: RoundConfig, store: NodeStore, task: Task) -> torch.Tensor:
    payload = read_payload(msg.content, DOWNLINK_RECORD)
    arrays = msg.content.array_records[DOWNLINK_RECORD]
    template = task.build_model().state_dict()
    sizes = tensor_sizes(template)
    numel = sum(sizes)
    kind, base_version, version = lattice_header(payload)
    if version != config.integer(DOWNLINK_VERSION, 0):
        raise ProtocolError(f"downlink payload brings version {version}, the config says "
                            f"{config.integer(DOWNLINK_VERSION, 0)}")
    base = _base(arrays, config, store, task, numel)
    message = decode_lattice(payload, numel)
    if kind == SNAPSHOT:
        if DOWNLINK_STEPS_KEY not in arrays:
            raise ProtocolError("a downlink snapshot must carry the lattice steps")
        tensor_steps = read_flat(arrays[DOWNLINK_STEPS_KEY], len(sizes), f"{DOWNLINK_RECORD}[{DOWNLINK_STEPS_KEY}]")
        if not bool((tensor_steps > 0).all()):
            raise ProtocolError("downlink lattice steps must be positive")
        n = torch.from_numpy(message.values.copy())
    else:
        assert kind == CHANGE
        meta = store.get_meta("lattice.meta")
        held = store.get_bytes("lattice.n")
        steps_held = store.get_tensor("lattice.steps")
        if meta is None or held is None or steps_held is None:
            raise OutOfSyncError("this device holds no copy of the model; the coordinator must send a snapshot")
        if int(meta["version"]) != base_version:
            raise OutOfSyncError(f"this device holds version {meta['version']}, the change is from {base_version}")
        tensor_steps = steps_held
        n = _decode_stored(held, numel).clone()
        n[torch.from_numpy(message.indices)] += torch.from_numpy(message.values)
    steps = torch.repeat_interleave(tensor_steps, torch.tensor(sizes))
    copy = lattice_model(base, steps, n)
    expected = config.integer(DOWNLINK_DIGEST, 0)
    if model_digest(copy) != expected:
        raise OutOfSyncError(f"this device's copy of version {version} does not match the coordinator's digest")
    # Stored compactly (the snapshot encoding); the digest check above passed, so this is the copy.
    store.put_bytes("lattice.n", encode_lattice(SNAPSHOT, numel, -1, version, n.numpy()))
    store.put_tensor("lattice.steps", tensor_steps)
    store.put_meta("lattice.meta", {"version": int(version)})
    return copy


def _decode_stored(stored: bytes, numel: int) -> torch.Tensor:
    return torch.from_numpy(decode_lattice(stored, numel).values)


def _base(arrays, config: RoundConfig, store: NodeStore, task: Task, numel: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The lattice's base: shipped with this message, shipped earlier and stored, or rebuilt from the
    task and seed and checked against the coordinator's digest."""
    expected = config.integer(DOWNLINK_BASE_DIGEST, 0)
    if DOWNLINK_BASE_KEY in arrays:
        base = read_flat(arrays[DOWNLINK_BASE_KEY], numel, f"{DOWNLINK_RECORD}[{DOWNLINK_BASE_KEY}]")
        if model_digest(base) != expected:
            raise ProtocolError("the shipped downlink base does not match its digest")
        store.put_tensor("lattice.base", base)
        return base
    stored = store.get_tensor("lattice.base")
    if stored is not None and stored.numel() == numel and model_digest(stored) == expected:
        return stored
    rebuilt = seeded_initial_params(task, config.seed)
    if model_digest(rebuilt) != expected:
        raise MissingBaseError("downlink base: this device's seeded initial model differs from the "
                             "coordinator's (another torch build?); it must be sent once")
    return rebuilt
