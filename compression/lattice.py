"""Integer vectors on the wire: the coordinator's model changes and snapshots on a fixed lattice.

The compressed downlink (``fedge.aggregation.broadcast``) keeps the model every device holds on a
lattice, ``x_hat = base + step * n`` with an integer vector ``n``. What it sends is therefore integer:
a *change* (a sparse ``dn``: sorted indices and non-zero values) or a *snapshot* (the dense ``n``).
Integers compose exactly, so the change over ten versions is the sum of ten changes, and a device
that applies it holds a copy bit-identical to the coordinator's. This module is only the encoding.

Format (little-endian)::

    magic "FGL1" | kind u8 (0 change, 1 snapshot) | width u8 | numel u64 | count u64 | escapes u64
    | base i64 | version i64 | [indices: delta varints, changes only] | escape positions (delta
    varints) | values | escape values (int32) | crc32 u32

Values are zig-zag mapped (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) and stored in ``width`` bits (1..8
bit-packed, or 16); a value that does not fit below the all-ones code is stored as that code and
again, exactly, in the escape list. The width is chosen per message to minimise the size, so most
of a snapshot takes a few bits per coordinate and the rare outliers cost their exact value.
Every field is checked by :func:`decode_lattice` before anything is returned (:class:`PayloadError`).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from fedge.compression import bitpack
from fedge.compression.errors import PayloadError
from fedge.compression.varint import decode_indices, encode_indices

__all__ = ["CHANGE", "SNAPSHOT", "LatticeMessage", "decode_lattice", "encode_lattice", "lattice_header"]

MAGIC = b"FGL1"
CHANGE = 0
SNAPSHOT = 1
_HEAD = struct.Struct("<4sBBQQQqq")
_CRC = struct.Struct("<I")
_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
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


def _best_width(codes: np.ndarray) -> int:
    """The width that minimises packed values plus escapes (an escape costs ~2 + 4 bytes)."""
    if codes.size == 0:
        return 1
    ordered = np.sort(codes)
    best, best_cost = 16, None
    for width in _WIDTHS:
        escapes = ordered.size - int(np.searchsorted(ordered, np.uint64((1 << width) - 1), side="left"))
        cost = (ordered.size * width + 7) // 8 + 6 * escapes
        if best_cost is None or cost < best_cost:
            best, best_cost = width, cost
    return best


def _pack(codes: np.ndarray, width: int) -> bytes:
    if width == 16:
        return codes.astype("<u2").tobytes()
    return bitpack.pack(codes.astype(np.uint8), width)


def _packed_size(count: int, width: int) -> int:
    return 2 * count if width == 16 else bitpack.packed_size(count, width)


def _unpack(data: memoryview, count: int, width: int) -> np.ndarray:
    if width == 16:
        return np.frombuffer(data, dtype="<u2").astype(np.uint64)
    return bitpack.unpack(data, count, width).astype(np.uint64)


def encode_lattice(kind: int, numel: int, base: int, version: int, values: np.ndarray,
                   indices: np.ndarray | None = None) -> bytes:
    """Encode a change (``indices`` strictly increasing, ``values`` non-zero) or a snapshot (dense
    ``values`` of length ``numel``)."""
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    if values.size and int(np.abs(values).max()) > MAX_VALUE:
        raise ValueError(f"a lattice value exceeds {MAX_VALUE}")
    if kind == SNAPSHOT:
        if values.size != numel or indices is not None:
            raise ValueError("a snapshot carries one value per coordinate and no indices")
        index_bytes = b""
    elif kind == CHANGE:
        if indices is None or np.asarray(indices).size != values.size:
            raise ValueError("a change needs one index per value")
        index_bytes = encode_indices(np.asarray(indices, dtype=np.int64))
    else:
        raise ValueError(f"unknown lattice message kind {kind}")
    codes = _zigzag(values)
    width = _best_width(codes)
    escape_code = np.uint64((1 << width) - 1)
    escaped = np.flatnonzero(codes >= escape_code)
    stored = np.where(codes >= escape_code, escape_code, codes)
    head = _HEAD.pack(MAGIC, kind, width, numel, values.size, escaped.size, base, version)
    body = b"".join((index_bytes, encode_indices(escaped), _pack(stored, width),
                     values[escaped].astype("<i4").tobytes()))
    return head + body + _CRC.pack(zlib.crc32(body, zlib.crc32(head)))


def lattice_header(data: bytes | memoryview) -> tuple[int, int, int]:
    """(kind, base, version) of a payload, checked for size and magic only (to route it)."""
    view = memoryview(data)
    if len(view) < _HEAD.size + _CRC.size:
        raise PayloadError(f"lattice payload of {len(view)} bytes is shorter than its header")
    magic, kind, _, _, _, _, base, version = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise PayloadError("not a lattice payload (bad magic)")
    return kind, base, version


def decode_lattice(data: bytes | memoryview, numel: int) -> LatticeMessage:
    """Decode and validate a payload meant for a model of ``numel`` coordinates."""
    view = memoryview(data)
    lattice_header(view)
    magic, kind, width, declared, count, escapes, base, version = _HEAD.unpack_from(view)
    if kind not in (CHANGE, SNAPSHOT):
        raise PayloadError(f"unknown lattice message kind {kind}")
    if width not in _WIDTHS:
        raise PayloadError(f"value width {width} is not one of {_WIDTHS}")
    if declared != numel:
        raise PayloadError(f"payload is for {declared} coordinates, the model has {numel}")
    if count > numel or escapes > count:
        raise PayloadError(f"{count} values and {escapes} escapes do not fit {numel} coordinates")
    if kind == SNAPSHOT and (count != numel or base != -1):
        raise PayloadError("a snapshot must carry every coordinate and no base version")
    if version < 0 or (kind == CHANGE and not 0 <= base <= version):
        raise PayloadError(f"versions out of order: base {base}, version {version}")
    (crc,) = _CRC.unpack_from(view, len(view) - _CRC.size)
    body = view[_HEAD.size: len(view) - _CRC.size]
    if zlib.crc32(body, zlib.crc32(view[: _HEAD.size])) != crc:
        raise PayloadError("lattice payload checksum mismatch (corrupted in transit)")
    value_bytes = _packed_size(count, width)
    escape_value_bytes = 4 * escapes
    rest = len(body) - value_bytes - escape_value_bytes
    if rest < 0:
        raise PayloadError("lattice payload is shorter than its declared values")
    # The index and escape-position sections are varints of unknown total length: the change's
    # indices end where ``count`` varints end (a varint's last byte is < 0x80).
    varints = np.frombuffer(body[:rest], dtype=np.uint8)
    ends = np.flatnonzero(varints < 0x80)
    n_index = count if kind == CHANGE else 0
    if ends.size != n_index + escapes:
        raise PayloadError(f"expected {n_index + escapes} varints, found {ends.size}")
    split = int(ends[n_index - 1]) + 1 if n_index else 0
    if n_index + escapes and int(ends[-1]) + 1 != rest:
        raise PayloadError("trailing bytes after the varint sections")
    indices = (decode_indices(body[:split], n_index, numel) if kind == CHANGE
               else np.arange(numel, dtype=np.int64))
    codes = _unpack(body[rest: rest + value_bytes], count, width)
    positions = decode_indices(body[split:rest], escapes, max(count, 1))
    exact = np.frombuffer(body[rest + value_bytes:], dtype="<i4").astype(np.int64)
    escape_code = np.uint64((1 << width) - 1)
    marked = np.flatnonzero(codes == escape_code)
    if marked.size != escapes or (escapes and not np.array_equal(marked, positions)):
        raise PayloadError("escape positions do not match the escaped values")
    values = _unzigzag(codes)
    values[positions] = exact
    if escapes and (_zigzag(exact) < escape_code).any():
        raise PayloadError("an escaped value would have fitted its width (non-canonical)")
    if kind == CHANGE and (values == 0).any():
        raise PayloadError("a change carries a zero value")
    return LatticeMessage(kind, numel, int(base), int(version), indices, values)
