"""The receiving end of the versioned lattice downlink: one device's copy, brought up to date.

``fedge.aggregation.broadcast`` (the coordinator) sends each device a lattice change from the
version it believes the device holds, or a snapshot. Whoever receives it, Fedge's own ClientApp
(``fedge.edge_client.downlink``, its copy in the node store) or a user's Flower app with
``fedge.flower.compression_mod`` (its copy in the node's ``Context`` state), applies it here: the
same checks, the same bits. The caller keeps the :class:`LatticeCopy` and supplies the base.

Anything that does not fit (a change from another version, no copy, a digest mismatch) raises
:class:`OutOfSyncError`; a malformed record raises :class:`ProtocolError` (or the codec's
``PayloadError``). No copy that differs from the coordinator's is ever returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord

from fedge.compression.errors import PayloadError
from fedge.compression.lattice import (
    CHANGE,
    SNAPSHOT,
    decode_lattice,
    encode_lattice,
    lattice_header,
    lattice_model,
    model_digest,
)
from fedge.protocol.records import (
    DOWNLINK_BASE_KEY,
    DOWNLINK_STEPS_KEY,
    PAYLOAD_KEY,
    ProtocolError,
    flat_array,
    payload_array,
    payload_bytes,
    read_flat,
)
from fedge.protocol.refusals import OutOfSyncError

__all__ = ["LatticeCopy", "apply_downlink", "downlink_record", "shipped_base"]


@dataclass(frozen=True)
class LatticeCopy:
    """What a device holds: ``version``, its integer coordinates ``n`` and the per-tensor steps."""

    version: int
    n: torch.Tensor  # int64
    tensor_steps: torch.Tensor  # float32, one per tensor

    def encode(self) -> bytes:
        """``n`` compactly (the snapshot encoding: a few bits per coordinate) for storage."""
        return encode_lattice(SNAPSHOT, self.n.numel(), -1, self.version, self.n.numpy())

    @classmethod
    def decode(cls, data: bytes, numel: int, tensor_steps: torch.Tensor) -> LatticeCopy | None:
        """A stored copy, or None when what was stored is not a copy of this model (truncated, another
        size): the device then holds no copy, and a change it gets raises :class:`OutOfSyncError`."""
        try:
            _, _, version = lattice_header(data)
            values = decode_lattice(data, numel).values
        except PayloadError:
            return None
        if tensor_steps.dim() != 1 or not bool((tensor_steps > 0).all()):
            return None
        return cls(int(version), torch.from_numpy(values.copy()), tensor_steps)


def downlink_record(payload: bytes, steps: torch.Tensor | None, base: torch.Tensor | None) -> ArrayRecord:
    """The one downlink record both coordinators send: the lattice message's ``payload``, with a
    snapshot its per-tensor ``steps``, and the flat ``base`` for a node that cannot build it."""
    arrays = {PAYLOAD_KEY: payload_array(payload)}
    if steps is not None:
        arrays[DOWNLINK_STEPS_KEY] = flat_array(steps)
    if base is not None:
        arrays[DOWNLINK_BASE_KEY] = flat_array(base)
    return ArrayRecord(arrays)


def shipped_base(record: ArrayRecord, numel: int, digest: int) -> torch.Tensor | None:
    """The lattice's base if this message ships it (checked against the coordinator's digest)."""
    if DOWNLINK_BASE_KEY not in record:
        return None
    base = read_flat(record[DOWNLINK_BASE_KEY], numel, f"downlink[{DOWNLINK_BASE_KEY}]")
    if model_digest(base) != digest:
        raise ProtocolError("the shipped downlink base does not match its digest")
    return base


def apply_downlink(record: ArrayRecord, sizes: list[int], base: torch.Tensor, held: LatticeCopy | None, *,
                   version: int, digest: int) -> tuple[torch.Tensor, LatticeCopy]:
    """The flat copy of ``version`` (checked against ``digest``) and the new :class:`LatticeCopy`,
    from a downlink record (``payload``, with a snapshot its ``steps``) applied to ``held``."""
    if PAYLOAD_KEY not in record:
        raise ProtocolError(f"the downlink record has no {PAYLOAD_KEY!r} array")
    payload = payload_bytes(record[PAYLOAD_KEY], f"downlink[{PAYLOAD_KEY}]")
    numel = sum(sizes)
    if base.numel() != numel:
        raise ProtocolError(f"the downlink base has {base.numel()} coordinates, the model {numel}")
    kind, base_version, brings = lattice_header(payload)
    if brings != version:
        raise ProtocolError(f"downlink payload brings version {brings}, the config says {version}")
    message = decode_lattice(payload, numel)
    if kind == SNAPSHOT:
        if DOWNLINK_STEPS_KEY not in record:
            raise ProtocolError("a downlink snapshot must carry the lattice steps")
        tensor_steps = read_flat(record[DOWNLINK_STEPS_KEY], len(sizes), f"downlink[{DOWNLINK_STEPS_KEY}]")
        if not bool((tensor_steps > 0).all()):
            raise ProtocolError("downlink lattice steps must be positive")
        n = torch.from_numpy(message.values.copy())
    else:
        assert kind == CHANGE
        if held is None:
            raise OutOfSyncError("this device holds no copy of the model; the coordinator must send a snapshot")
        if held.version != base_version:
            raise OutOfSyncError(f"this device holds version {held.version}, the change is from {base_version}")
        tensor_steps = held.tensor_steps
        n = held.n.clone()
        n[torch.from_numpy(message.indices)] += torch.from_numpy(message.values)
    steps = torch.repeat_interleave(tensor_steps, torch.tensor(sizes))
    copy = lattice_model(base, steps, n)
    if model_digest(copy) != digest:
        raise OutOfSyncError(f"this device's copy of version {version} does not match the coordinator's digest")
    return copy, LatticeCopy(int(version), n, tensor_steps)
