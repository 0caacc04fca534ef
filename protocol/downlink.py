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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord

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
from fedge.protocol.config_keys import DOWNLINK_BASE_DIGEST, DOWNLINK_CODEC, DOWNLINK_DIGEST, DOWNLINK_VERSION
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
from fedge.protocol.round_config import typed_value

__all__ = ["DownlinkHeader", "LatticeCopy", "apply_downlink", "downlink_record", "shipped_base"]


@dataclass(frozen=True)
class DownlinkHeader:
    """What a lattice downlink message says in its config beside its record: the codec, the version
    it brings, that version's digest and the lattice base's. The coordinator's downlink layer writes
    it; Fedge's devices and a Flower app's nodes read it here, with the same checks."""

    codec: str
    version: int
    digest: int
    base_digest: int

    def write(self, config: ConfigRecord) -> None:
        config[DOWNLINK_CODEC], config[DOWNLINK_VERSION] = self.codec, int(self.version)
        config[DOWNLINK_DIGEST], config[DOWNLINK_BASE_DIGEST] = int(self.digest), int(self.base_digest)

    @classmethod
    def read(cls, config: Mapping[str, Any] | None) -> DownlinkHeader | None:
        """The header a message's config carries; None when the model rides in full (no config, no
        downlink codec, or ``none``). Raises :class:`ProtocolError` for a partial or mistyped one."""
        codec = "none" if config is None else config.get(DOWNLINK_CODEC, "none")
        if codec == "none":
            return None
        version, digest, base = (typed_value(key, config.get(key), int, 0)
                                 for key in (DOWNLINK_VERSION, DOWNLINK_DIGEST, DOWNLINK_BASE_DIGEST))
        return cls(typed_value(DOWNLINK_CODEC, codec, str), version, digest, base)


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
