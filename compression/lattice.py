"""Integer vectors on the wire: the coordinator's model changes and snapshots on a fixed lattice.

The compressed downlink (``fedge.aggregation.broadcast``) keeps the model every device holds on a
lattice, ``x_hat = base + step * n`` with an integer vector ``n``. What it sends is therefore integer:
a *change* (a sparse ``dn``: sorted indices and non-zero values) or a *snapshot* (the dense ``n``).
Integers compose exactly, so the change over ten versions is the sum of ten changes, and a device
that applies it holds a copy bit-identical to the coordinator's. This module is only the encoding.

Format (little-endian)::

    magic "FGL2" | kind u8 (0 change, 1 snapshot, 2 sparse snapshot) | width u8 | index coding u8 | rice k u8
    | numel u64 | count u64 | escapes u64 | base i64 | version i64 | index bytes u64
    | [indices, changes only] | escape positions (delta varints) | values | escape values (int32)
    | crc32 u32

Values are zig-zag mapped (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) and stored either in ``width``
bits (1..8 bit-packed, or 16) or, with ``width`` 0, Rice-coded with parameter ``k``
(:mod:`fedge.compression.rice`). A value that does not fit (the all-ones code of its width; in
Rice coding a quotient of 32 or more) is stored as that escape code and again, exactly, in the
escape list. The encoder picks the coding that gives the fewest bytes, so most of a snapshot takes
a few bits per coordinate and the rare outliers cost their exact value. A change's indices are an
index set (:mod:`fedge.compression.index_sets`: varint or Rice gaps, whichever is smaller; a
catch-up over many versions is dense enough for Rice gaps to cost 3-4 bits instead of 8). A
snapshot goes dense (every coordinate) or sparse (the non-zero coordinates of ``n`` as an index set:
early in a run most of ``n`` is still zero), whichever is smaller; both decode to a snapshot.
Every field is checked by :func:`decode_lattice` before anything is returned (:class:`PayloadError`).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from fedge.compression import bitpack, rice
from fedge.compression.errors import PayloadError
from fedge.compression.index_sets import SCHEMES, decode_index_set, encode_index_set
from fedge.compression.varint import decode_indices, encode_indices

__all__ = ["CHANGE", "SNAPSHOT", "LatticeMessage", "change_support", "decode_lattice", "encode_lattice",
           "lattice_header", "lattice_model", "model_digest"]

MAGIC = b"FGL2"
CHANGE = 0
SNAPSHOT = 1
_SPARSE_SNAPSHOT = 2  # on the wire only: decodes to a SNAPSHOT
_HEAD = struct.Struct("<4sBBBBQQQqqQ")
_CRC = struct.Struct("<I")
_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
_RICE = 0  # the width field's value for Rice-coded values
_RICE_QUOTIENT = 32  # Rice codes with a larger quotient are escaped
_ESCAPE_COST = 6  # bytes: ~2 of position varint + 4 of exact value
#: the largest |value| the format carries (int32, as n is stored on devices)
MAX_VALUE = 2**31 - 1


@dataclass(frozen=True)
class LatticeMessage:
    """A decoded message: ``values`` at ``indices`` (a change) or at every index (a snapshot)."""

    kind: int
    numel: int
    base: int  # the version a change applies to (-1 for a snapshot)
    version: int  # the version the receiver holds afterwards
    indices: np.ndarray  # int64, strictly increasing (a snapshot: arange(numel))
    values: np.ndarray  # int64


def _zigzag(values: np.ndarray) -> np.ndarray:
    v = values.astype(np.int64)
    return ((v << 1) ^ (v >> 63)).astype(np.uint64)


def _unzigzag(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.uint64)
    return ((c >> np.uint64(1)).astype(np.int64)) ^ -((c & np.uint64(1)).astype(np.int64))


def _escape_code(width: int, k: int) -> np.uint64:
    """The code that marks an escaped value (and the smallest code that is escaped)."""
    return np.uint64(_RICE_QUOTIENT << k) if width == _RICE else np.uint64((1 << width) - 1)


def _best_coding(codes: np.ndarray) -> tuple[int, int]:
    """(width, rice k) minimising packed values plus escapes over every fixed width and Rice."""
    if codes.size == 0:
        return 1, 0
    ordered = np.sort(codes)

    def escapes(code: np.uint64) -> int:
        return ordered.size - int(np.searchsorted(ordered, code, side="left"))

    options = []
    for width in _WIDTHS:
        cost = _packed_size(ordered.size, width) + _ESCAPE_COST * escapes(_escape_code(width, 0))
        options.append((cost, width, 0))
    k = rice.best_parameter(np.minimum(ordered, np.uint64(1 << 40)))
    capped = np.minimum(ordered, _escape_code(_RICE, k))
    options.append((rice.encoded_size(capped, k) + _ESCAPE_COST * escapes(_escape_code(_RICE, k)), _RICE, k))
    _, width, k = min(options)
    return width, k


def _pack(codes: np.ndarray, width: int, k: int) -> bytes:
    if width == _RICE:
        return rice.encode(codes, k)
    if width == 16:
        return codes.astype("<u2").tobytes()
    return bitpack.pack(codes.astype(np.uint8), width)


def _packed_size(count: int, width: int) -> int:
    return 2 * count if width == 16 else bitpack.packed_size(count, width)


def _unpack(data: memoryview, count: int, width: int, k: int) -> np.ndarray:
    if width == _RICE:
        return rice.decode(data, count, k)
    if len(data) != _packed_size(count, width):
        raise PayloadError(f"{len(data)} value bytes, {_packed_size(count, width)} expected for {count} values")
    if width == 16:
        return np.frombuffer(data, dtype="<u2").astype(np.uint64)
    return bitpack.unpack(data, count, width).astype(np.uint64)


def encode_lattice(kind: int, numel: int, base: int, version: int, values: np.ndarray,
                   indices: np.ndarray | None = None) -> bytes:
    """Encode a change (``indices`` strictly increasing, ``values`` non-zero) or a snapshot (dense
    ``values`` of length ``numel``; sent dense or as its non-zero entries, whichever is smaller)."""
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    if values.size and int(np.abs(values).max()) > MAX_VALUE:
        raise ValueError(f"a lattice value exceeds {MAX_VALUE}")
    if kind == SNAPSHOT:
        if values.size != numel or indices is not None:
            raise ValueError("a snapshot carries one value per coordinate and no indices")
        dense = _encode(SNAPSHOT, numel, base, version, values, None)
        nonzero = np.flatnonzero(values)
        if nonzero.size * 2 > numel:  # the index set would cost more than the zeros it removes
            return dense
        sparse = _encode(_SPARSE_SNAPSHOT, numel, base, version, values[nonzero], nonzero)
        return sparse if len(sparse) < len(dense) else dense
    if kind == CHANGE:
        if indices is None or np.asarray(indices).size != values.size:
            raise ValueError("a change needs one index per value")
        return _encode(CHANGE, numel, base, version, values, np.asarray(indices, dtype=np.int64))
    raise ValueError(f"unknown lattice message kind {kind}")


def _encode(wire_kind: int, numel: int, base: int, version: int, values: np.ndarray,
            indices: np.ndarray | None) -> bytes:
    scheme, index_bytes = (0, b"") if indices is None else encode_index_set(indices)
    codes = _zigzag(values)
    width, k = _best_coding(codes)
    escape_code = _escape_code(width, k)
    escaped = np.flatnonzero(codes >= escape_code)
    stored = np.where(codes >= escape_code, escape_code, codes)
    head = _HEAD.pack(MAGIC, wire_kind, width, scheme, k, numel, values.size, escaped.size, base, version,
                      len(index_bytes))
    body = b"".join((index_bytes, encode_indices(escaped), _pack(stored, width, k),
                     values[escaped].astype("<i4").tobytes()))
    return head + body + _CRC.pack(zlib.crc32(body, zlib.crc32(head)))


def lattice_header(data: bytes | memoryview) -> tuple[int, int, int]:
    """(kind, base, version) of a payload, checked for size and magic only (to route it)."""
    view = memoryview(data)
    if len(view) < _HEAD.size + _CRC.size:
        raise PayloadError(f"lattice payload of {len(view)} bytes is shorter than its header")
    magic, kind, *_, base, version, _ = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise PayloadError("not a lattice payload (bad magic)")
    return (SNAPSHOT if kind == _SPARSE_SNAPSHOT else kind), base, version


def change_support(data: bytes | memoryview, numel: int) -> np.ndarray:
    """The coordinates a change payload moves (sorted int64), empty for a snapshot: what the node
    that applied it and the coordinator that sent it both know (``compression.shared_support``)."""
    message = decode_lattice(data, numel)
    return message.indices if message.kind == CHANGE else np.zeros(0, dtype=np.int64)


def decode_lattice(data: bytes | memoryview, numel: int) -> LatticeMessage:
    """Decode and validate a payload meant for a model of ``numel`` coordinates."""
    view = memoryview(data)
    lattice_header(view)
    magic, kind, width, scheme, k, declared, count, escapes, base, version, index_length = _HEAD.unpack_from(view)
    if kind not in (CHANGE, SNAPSHOT, _SPARSE_SNAPSHOT):
        raise PayloadError(f"unknown lattice message kind {kind}")
    if width not in (*_WIDTHS, _RICE) or scheme not in SCHEMES or k > rice.MAX_K - 6:
        raise PayloadError(f"value width {width}, index coding {scheme} or Rice parameter {k} is unknown")
    if declared != numel:
        raise PayloadError(f"payload is for {declared} coordinates, the model has {numel}")
    if count > numel or escapes > count:
        raise PayloadError(f"{count} values and {escapes} escapes do not fit {numel} coordinates")
    if kind == SNAPSHOT and (count != numel or base != -1 or index_length):
        raise PayloadError("a snapshot must carry every coordinate, no indices and no base version")
    if kind == _SPARSE_SNAPSHOT and base != -1:
        raise PayloadError("a snapshot has no base version")
    if version < 0 or (kind == CHANGE and not 0 <= base <= version):
        raise PayloadError(f"versions out of order: base {base}, version {version}")
    (crc,) = _CRC.unpack_from(view, len(view) - _CRC.size)
    body = view[_HEAD.size: len(view) - _CRC.size]
    if zlib.crc32(body, zlib.crc32(view[: _HEAD.size])) != crc:
        raise PayloadError("lattice payload checksum mismatch (corrupted in transit)")
    escape_value_bytes = 4 * escapes
    if index_length + escape_value_bytes > len(body):
        raise PayloadError("lattice payload is shorter than its declared sections")
    indices = (np.arange(numel, dtype=np.int64) if kind == SNAPSHOT
               else decode_index_set(scheme, body[:index_length], count, numel))
    # The escape positions are varints: they end where ``escapes`` varints end (last byte < 0x80).
    rest = body[index_length: len(body) - escape_value_bytes]
    ends = np.flatnonzero(np.frombuffer(rest, dtype=np.uint8) < 0x80)
    if ends.size < escapes:
        raise PayloadError(f"expected {escapes} escape positions, found {ends.size}")
    split = int(ends[escapes - 1]) + 1 if escapes else 0
    positions = decode_indices(rest[:split], escapes, max(count, 1))
    codes = _unpack(rest[split:], count, width, k)
    exact = np.frombuffer(body[len(body) - escape_value_bytes:], dtype="<i4").astype(np.int64)
    escape_code = _escape_code(width, k)
    marked = np.flatnonzero(codes >= escape_code)
    if marked.size != escapes or (escapes and not np.array_equal(marked, positions)):
        raise PayloadError("escape positions do not match the escaped values")
    if (codes > escape_code).any():
        raise PayloadError("a value code exceeds its escape code (non-canonical)")
    values = _unzigzag(codes)
    values[positions] = exact
    if escapes and (_zigzag(exact) < escape_code).any():
        raise PayloadError("an escaped value would have fitted its coding (non-canonical)")
    if kind != SNAPSHOT and (values == 0).any():
        raise PayloadError("a sparse message carries a zero value")
    if kind == _SPARSE_SNAPSHOT:
        dense = np.zeros(numel, dtype=np.int64)
        dense[indices] = values
        return LatticeMessage(SNAPSHOT, numel, -1, int(version), np.arange(numel, dtype=np.int64), dense)
    return LatticeMessage(kind, numel, int(base), int(version), indices, values)


def model_digest(vector: torch.Tensor) -> int:
    """56-bit BLAKE2b digest of a flat fp32 vector's bytes (fits a Flower int64 metric)."""
    data = vector.detach().to(torch.float32).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def lattice_model(base: torch.Tensor, steps: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``base + (steps * n)`` as two element-wise float32 operations: the same bits everywhere."""
    scaled = steps * n.to(torch.float32)
    return base + scaled
