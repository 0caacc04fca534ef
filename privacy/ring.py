"""The ring of the masked sum: Z_{2^r}, sized before the round so the sum cannot wrap.

Unsigned b-bit levels from at most n devices sum to at most n (2^b - 1) < 2^(b + ceil(log2 n)), so
a ring of ``b + ceil(log2 n)`` bits holds the exact sum; masks are uniform in the ring and cancel
mod 2^r. Masked values do not compress, so an upload is exactly ``d * r`` bits, bit-packed here
(numpy's uint32 arithmetic wraps mod 2^32 and 2^r divides 2^32, so masking the low r bits is exact).
"""

from __future__ import annotations

import math

import numpy as np

from fedge.privacy.errors import MaskedInputError, RingError

__all__ = ["MAX_RING_BITS", "ring_bits", "ring_mask", "packed_ring_size", "pack_ring", "unpack_ring"]

#: the widest ring: sums are computed in uint32
MAX_RING_BITS = 32


def ring_bits(level_bits: int, max_summands: int, headroom_bits: int = 0) -> int:
    """Bits of the smallest ring that holds the sum of ``max_summands`` values of ``level_bits`` bits.

    ``headroom_bits`` adds room for anything else summed in the same coordinates (discrete noise).
    Raises :class:`RingError` when that exceeds 32 bits.
    """
    if not 1 <= level_bits <= 16:
        raise RingError(f"quantization bits must be in [1, 16], got {level_bits}")
    if max_summands < 1:
        raise RingError(f"a ring for {max_summands} summands makes no sense")
    if headroom_bits < 0:
        raise RingError(f"headroom bits must be >= 0, got {headroom_bits}")
    bits = level_bits + math.ceil(math.log2(max_summands)) + headroom_bits
    if bits > MAX_RING_BITS:
        raise RingError(f"{max_summands} summands of {level_bits} bits (+{headroom_bits} headroom) need a "
                        f"{bits}-bit ring; at most {MAX_RING_BITS} bits are supported")
    return max(bits, 1)


def ring_mask(bits: int) -> np.uint32:
    """The low-``bits`` mask, for reducing uint32 values mod 2^bits."""
    _check(bits)
    return np.uint32((1 << bits) - 1) if bits < 32 else np.uint32(0xFFFFFFFF)


def packed_ring_size(count: int, bits: int) -> int:
    """Bytes of ``count`` ring elements of ``bits`` bits, bit-packed."""
    _check(bits)
    return (count * bits + 7) // 8


def pack_ring(values: np.ndarray, bits: int) -> bytes:
    """Bit-pack uint32 ring elements (each < 2^bits), little-endian bit order."""
    _check(bits)
    values = np.ascontiguousarray(values, dtype="<u4").reshape(-1)
    if bits == 32:
        return values.tobytes()
    if bits == 16:
        return values.astype("<u2").tobytes()
    if bits == 8:
        return values.astype(np.uint8).tobytes()
    as_bytes = values.view(np.uint8).reshape(-1, 4)
    bit_rows = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :bits]
    return np.packbits(bit_rows.reshape(-1), bitorder="little").tobytes()


def unpack_ring(data: bytes | memoryview, count: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_ring`; raises :class:`MaskedInputError` on a wrong length."""
    _check(bits)
    raw = np.frombuffer(data, dtype=np.uint8)
    expected = packed_ring_size(count, bits)
    if raw.size != expected:
        raise MaskedInputError(f"expected {expected} bytes for {count} ring elements of {bits} bits, "
                               f"got {raw.size}")
    if bits == 32:
        return raw.view("<u4").astype(np.uint32)
    if bits == 16:
        return raw.view("<u2").astype(np.uint32)
    if bits == 8:
        return raw.astype(np.uint32)
    bit_rows = np.unpackbits(raw, bitorder="little")[: count * bits].reshape(count, bits)
    padded = np.zeros((count, 32), dtype=np.uint8)
    padded[:, :bits] = bit_rows
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").reshape(-1).astype(np.uint32)


def _check(bits: int) -> None:
    if not 1 <= bits <= MAX_RING_BITS:
        raise RingError(f"ring bits must be in [1, {MAX_RING_BITS}], got {bits}")
