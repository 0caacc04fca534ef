"""Bit-packing of small unsigned integers (1 to 8 bits per value) into bytes.

Values are packed little-endian within each byte (value ``j`` of a byte occupies bits
``[j*b, (j+1)*b)``), so the layout does not depend on the host. Widths that divide 8 use a
shift-and-or fast path; other widths go through ``numpy.packbits``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["packed_size", "pack", "unpack"]


def packed_size(count: int, bits: int) -> int:
    """Bytes needed to hold ``count`` values of ``bits`` bits each."""
    _check_bits(bits)
    return (count * bits + 7) // 8


def pack(values: np.ndarray, bits: int) -> bytes:
    """Pack a 1-D uint8 array whose entries all fit in ``bits`` bits."""
    _check_bits(bits)
    values = np.ascontiguousarray(values, dtype=np.uint8).reshape(-1)
    count = values.size
    if bits == 8:
        return values.tobytes()
    if 8 % bits == 0:
        per_byte = 8 // bits
        padded = np.zeros(-(-count // per_byte) * per_byte, dtype=np.uint8)
        padded[:count] = values
        lanes = padded.reshape(-1, per_byte)
        out = lanes[:, 0].copy()
        for j in range(1, per_byte):
            out |= lanes[:, j] << np.uint8(j * bits)
        return out.tobytes()
    bit_matrix = np.unpackbits(values[:, None], axis=1, bitorder="little")[:, :bits]
    return np.packbits(bit_matrix.reshape(-1), bitorder="little").tobytes()


def unpack(data: bytes | memoryview | np.ndarray, count: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack`. ``data`` must be exactly ``packed_size(count, bits)`` bytes."""
    _check_bits(bits)
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if raw.size != packed_size(count, bits):
        raise ValueError(f"expected {packed_size(count, bits)} packed bytes, got {raw.size}")
    if bits == 8:
        return raw.copy()
    if 8 % bits == 0:
        per_byte = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        out = np.empty((raw.size, per_byte), dtype=np.uint8)
        for j in range(per_byte):
            out[:, j] = (raw >> np.uint8(j * bits)) & mask
        return out.reshape(-1)[:count]
    bit_stream = np.unpackbits(raw, bitorder="little")[: count * bits].reshape(count, bits)
    return np.packbits(bit_stream, axis=1, bitorder="little").reshape(-1)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
