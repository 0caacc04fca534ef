"""The numba-compiled kernels behind :mod:`fedge.compression.kernels`, in a module of their own.

Importing numba and loading the compiled kernels from its cache costs about a second of CPU, which
a process that never encodes or decodes a payload (the CLI's checks, a ServerApp before its first
reply) should not pay: :func:`fedge.compression.kernels.available` imports this module the first
time a codec asks for the fused path. Importing it raises ``ImportError`` when numba is missing,
when ``FEDGE_KERNELS=off``, or on a big-endian host (the kernels view wire bytes as native
float32); the torch reference path runs then. See :mod:`fedge.compression.kernels` for the design.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

if os.environ.get("FEDGE_KERNELS", "on").lower() in ("off", "0", "false"):
    raise ImportError("disabled by FEDGE_KERNELS")
if sys.byteorder != "little":
    raise ImportError("fused kernels assume a little-endian host")

import numba  # noqa: E402

from fedge.compression.kernel_cache import install as _install_cache  # noqa: E402

_install_cache()  # before the decorators below: one cache for every copy of this file (kernel_cache.py)

# fastmath without nnan/ninf: the kernels must still see NaN and infinity to reject them.
_FM = {"nsz", "arcp", "contract", "afn", "reassoc"}
_jit: Any = numba.njit(cache=True, nogil=True, boundscheck=False, fastmath=_FM)
_inline: Any = numba.njit(inline="always")

_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)
_ABS32 = np.uint32(0x7FFFFFFF)  # float32 bits without the sign


@_inline
def _hash32(i, seed):  # type: ignore[no-untyped-def]
    x = np.uint32(np.uint32(i) ^ seed)
    x = np.uint32(x ^ (x >> np.uint32(16)))
    x = np.uint32(x * np.uint32(0x7FEB352D))
    x = np.uint32(x ^ (x >> np.uint32(15)))
    x = np.uint32(x * np.uint32(0x846CA68B))
    return np.uint32(x ^ (x >> np.uint32(16)))

@_inline
def _qsgd_code(v, index, seed, top):  # type: ignore[no-untyped-def]
    """levels + sign * stochastically rounded |v| (v already scaled to 0..levels)."""
    u = np.float32(_hash32(index, seed) >> np.uint32(8)) * np.float32(1.0 / 16777216.0)
    level = min(np.int32(abs(v) + u), top)  # floor: abs(v) + u >= 0
    return np.uint8(top + level - 2 * np.int32(v < 0) * level)  # integer sign: vectorizes

@_inline
def _bucket_scale(x, xu, start, bucket, l2, scales, scales_u, b):  # type: ignore[no-untyped-def]
    """Write bucket ``b``'s scale; status 1 = non-finite input, 2 = L2 norm beyond float32.

    The max norm works on the float bits as uint32: for |x| the bit patterns order like the
    values, an integer max vectorizes where a NaN-aware float max does not, and any pattern
    >= 0x7f800000 is an infinity or a NaN.
    """
    if l2:
        xb = x[start : start + bucket]
        acc = 0.0
        for k in range(xb.size):
            acc += np.float64(xb[k]) * np.float64(xb[k])
        if not acc <= 1.7976931348623157e308:
            return 1
        norm = np.sqrt(acc)
        if norm > _F32_MAX:
            return 2
        scales[b] = np.float32(norm)
        return 0
    m = max_magnitude_bits(xu[start : start + bucket], _ABS32)
    if m >= np.uint32(0x7F800000):
        return 1
    scales_u[b] = m  # the bits of max|x|: no float conversion involved
    return 0

@_jit
def qsgd_encode(x, xu, bucket, levels, l2, seed, scales, scales_u, codes):  # type: ignore[no-untyped-def]
    """Codes path (any width): returns 0, or the status of the first bad bucket."""
    s = np.float32(levels)
    top = np.int32(levels)
    for b in range(scales.size):
        start = b * bucket
        xb = x[start : start + bucket]
        cb = codes[start : start + bucket]
        status = _bucket_scale(x, xu, start, bucket, l2, scales, scales_u, b)
        if status:
            return status
        scale = scales[b]
        inv = s / max(scale, np.float32(_F32_TINY))
        for k in range(xb.size):
            cb[k] = _qsgd_code(xb[k] * inv, start + k, seed, top)
    return 0

@_jit
def terngrad_encode(x, xu, bucket, clip, seed, scales, codes):  # type: ignore[no-untyped-def]
    """Mean and variance in float32 like the reference; max of the clipped values as
    min(max |x|, bound), which needs no second pass."""
    inv24 = np.float32(1.0 / 16777216.0)
    for b in range(scales.size):
        start = b * bucket
        xb = x[start : start + bucket]
        cb = codes[start : start + bucket]
        top = max_magnitude_bits(xu[start : start + bucket], _ABS32)
        if top >= np.uint32(0x7F800000):
            return 1
        scales.view(np.uint32)[b] = top
        bound = np.float32(np.inf)
        if clip > 0:
            total = np.float32(0.0)
            for k in range(xb.size):
                total += xb[k]
            mean = total / np.float32(xb.size)
            var = np.float32(0.0)
            for k in range(xb.size):
                d = xb[k] - mean
                var += d * d
            bound = np.float32(clip) * np.sqrt(var / np.float32(xb.size))
        m = min(scales[b], bound)
        scales[b] = m
        inv = np.float32(1.0) / max(m, np.float32(_F32_TINY))
        for k in range(xb.size):
            v = xb[k]
            u = np.float32(_hash32(start + k, seed) >> np.uint32(8)) * inv24
            keep = np.int32(u < min(abs(v), bound) * inv)
            cb[k] = np.uint8(1 + keep * (np.int32(v > 0) - np.int32(v < 0)))
    return 0

@_jit
def sign_encode(x, xu, bucket, two_sided, scales, codes):  # type: ignore[no-untyped-def]
    """Scaled sign (one scale: mean |x|) or 1-bit with mean reconstruction (two scales);
    branch-free float32 sums like the reference."""
    zero = np.float32(0.0)
    for b in range(-(-codes.size // bucket)):
        start = b * bucket
        xb = x[start : start + bucket]
        cb = codes[start : start + bucket]
        if max_magnitude_bits(xu[start : start + bucket], _ABS32) >= np.uint32(0x7F800000):
            return 1
        pos = zero
        neg = zero
        npos = 0
        for k in range(xb.size):
            v = xb[k]
            cb[k] = np.uint8(v >= zero)
            pos += max(v, zero)
            neg += max(-v, zero)
            npos += np.int32(v >= zero)
        if two_sided:
            scales[2 * b] = pos / np.float32(max(npos, 1))
            scales[2 * b + 1] = neg / np.float32(max(xb.size - npos, 1))
        else:
            scales[b] = (pos + neg) / np.float32(xb.size)
    return 0

@_jit
def select_above(xu, threshold_bits, out):  # type: ignore[no-untyped-def]
    """Indices of |x| >= threshold, in order, into ``out``; -1 when ``out`` is too small, -2
    when an element is NaN or infinite. Works on the bits: for magnitudes the integer order
    is the float order, so one integer compare per element decides."""
    count = 0
    worst = np.uint32(0)
    for k in range(xu.size):
        magnitude = xu[k] & np.uint32(0x7FFFFFFF)
        worst = max(worst, magnitude)
        if magnitude >= threshold_bits:
            if count == out.size:
                return -1
            out[count] = k
            count += 1
    if worst >= np.uint32(0x7F800000):
        return -2
    return count

@_jit
def varint_encode(indices, out):  # type: ignore[no-untyped-def]
    """Delta + LEB128 of strictly increasing indices; bytes written, -1 if not increasing or
    negative, -2 if a gap needs more than 6 bytes."""
    previous = np.int64(-1)
    j = 0
    for i in range(indices.size):
        index = indices[i]
        if index <= previous:
            return -1
        gap = np.uint64(index) if i == 0 else np.uint64(index - previous)
        previous = index
        for _ in range(6):
            byte = np.uint8(gap & np.uint64(0x7F))
            gap >>= np.uint64(7)
            if gap:
                out[j] = byte | np.uint8(0x80)
                j += 1
            else:
                out[j] = byte
                j += 1
                break
        else:
            return -2
    return j

@_jit
def varint_decode(raw, count, limit, out):  # type: ignore[no-untyped-def]
    """Inverse of :func:`varint_encode`: 0, or -1 ends inside a varint, -2 wrong count, -3 a
    varint longer than 6 bytes, -4 not increasing, -5 index out of range."""
    j = 0
    total = np.int64(0)
    for i in range(count):
        value = np.uint64(0)
        shift = np.uint64(0)
        length = 0
        while True:
            if j >= raw.size:
                return -1
            byte = raw[j]
            j += 1
            length += 1
            if length > 6:
                return -3
            value |= np.uint64(byte & np.uint8(0x7F)) << shift
            shift += np.uint64(7)
            if byte < 0x80:
                break
        if i > 0 and value < 1:
            return -4
        if value >= np.uint64(limit):  # also keeps the running sum far from overflowing
            return -5
        total += np.int64(value)
        if total >= limit:
            return -5
        out[i] = total
    if j != raw.size:
        return -2
    return 0

@_jit
def scatter_add(out, indices, values, alpha):  # type: ignore[no-untyped-def]
    a = np.float32(alpha)
    for i in range(indices.size):
        out[indices[i]] += a * values[i]

@_jit
def max_magnitude_bits(raw, magnitude_mask):  # type: ignore[no-untyped-def]
    """Largest ``raw[k] & magnitude_mask`` (the float's bits without the sign)."""
    top = raw.dtype.type(0)
    for k in range(raw.size):
        top = max(top, raw[k] & magnitude_mask)
    return top

@_jit
def pack_stream(codes, bits, packed):  # type: ignore[no-untyped-def]
    acc = np.uint64(0)
    filled = 0
    j = 0
    for i in range(codes.size):
        acc |= np.uint64(codes[i]) << np.uint64(filled)
        filled += bits
        while filled >= 8:
            packed[j] = np.uint8(acc & np.uint64(255))
            acc >>= np.uint64(8)
            filled -= 8
            j += 1
    if filled > 0:
        packed[j] = np.uint8(acc & np.uint64(255))

def _specialise(bits: int) -> tuple[Any, Any, Any, Any]:
    """Kernels for one code width that divides 8, with the width as a compile-time constant
    (a runtime width leaves an inner loop of unknown trip count that does not vectorize)."""
    per = 8 // bits
    mask = (1 << bits) - 1

    @_jit
    def pack(codes, packed):  # type: ignore[no-untyped-def]
        full = codes.size // per
        for j in range(full):
            group = codes[j * per : j * per + per]
            byte = np.uint32(0)
            for t in range(per):
                byte |= np.uint32(group[t]) << np.uint32(t * bits)
            packed[j] = np.uint8(byte)
        byte = np.uint32(0)
        for t in range(codes.size - full * per):
            byte |= np.uint32(codes[full * per + t]) << np.uint32(t * bits)
        if full < packed.size:
            packed[full] = np.uint8(byte)

    @_jit
    def qsgd_packed(x, xu, bucket, levels, l2, seed, scales, scales_u, packed):  # type: ignore[no-untyped-def]
        """QSGD straight to packed bytes (``bucket`` a multiple of the codes per byte)."""
        s = np.float32(levels)
        top = np.int32(levels)
        stride = bucket // per
        for b in range(scales.size):
            start = b * bucket
            status = _bucket_scale(x, xu, start, bucket, l2, scales, scales_u, b)
            if status:
                return status
            scale = scales[b]
            inv = s / max(scale, np.float32(_F32_TINY))
            xb = x[start : start + bucket]
            pb = packed[b * stride : (b + 1) * stride]
            whole = xb.size // per
            for j in range(whole):
                byte = np.uint32(0)
                for t in range(per):
                    k = j * per + t
                    byte |= np.uint32(_qsgd_code(xb[k] * inv, start + k, seed, top)) << np.uint32(t * bits)
                pb[j] = np.uint8(byte)
            byte = np.uint32(0)
            for t in range(xb.size - whole * per):
                k = whole * per + t
                byte |= np.uint32(_qsgd_code(xb[k] * inv, start + k, seed, top)) << np.uint32(t * bits)
            if whole < pb.size:
                pb[whole] = np.uint8(byte)
        return 0

    @_jit
    def unpack_max(packed, n):  # type: ignore[no-untyped-def]
        top = np.uint8(0)
        full = n // per
        for j in range(full):
            byte = packed[j]
            for t in range(per):
                top = max(top, np.uint8((byte >> np.uint8(t * bits)) & np.uint8(mask)))
        for t in range(n - full * per):
            top = max(top, np.uint8((packed[full] >> np.uint8(t * bits)) & np.uint8(mask)))
        return top

    @_jit
    def accumulate(packed, n, bucket, offset, mult, alpha, out):  # type: ignore[no-untyped-def]
        off = np.float32(offset)
        a = np.float32(alpha)
        if bucket % per == 0:  # every bucket starts on a byte: walk bytes, `per` codes each
            stride = bucket // per
            for b in range(mult.size):
                m = mult[b]
                pb = packed[b * stride : (b + 1) * stride]
                ob = out[b * bucket : (b + 1) * bucket]
                whole = ob.size // per
                for j in range(whole):
                    byte = pb[j]
                    for t in range(per):
                        code = np.float32((byte >> np.uint8(t * bits)) & np.uint8(mask))
                        ob[j * per + t] += a * ((code - off) * m)
                for t in range(ob.size - whole * per):
                    code = np.float32((pb[whole] >> np.uint8(t * bits)) & np.uint8(mask))
                    ob[whole * per + t] += a * ((code - off) * m)
        else:
            for i in range(n):
                code = np.float32((packed[i // per] >> np.uint8((i % per) * bits)) & np.uint8(mask))
                out[i] += a * ((code - off) * mult[i // bucket])

    return unpack_max, accumulate, pack, qsgd_packed

BY_BITS = {bits: _specialise(bits) for bits in (1, 2, 4, 8)}

@_jit
def two_level_accumulate(packed, bucket, hi, lo, alpha, out):  # type: ignore[no-untyped-def]
    """1-bit codes: out[i] += alpha * (hi[b] if bit else -lo[b]), ``bucket`` a multiple of 8."""
    a = np.float32(alpha)
    stride = bucket // 8
    for b in range(hi.size):
        pb = packed[b * stride : (b + 1) * stride]
        ob = out[b * bucket : (b + 1) * bucket]
        h = hi[b]
        m = -lo[b]
        whole = ob.size // 8
        for j in range(whole):
            byte = pb[j]
            for t in range(8):
                ob[j * 8 + t] += a * (h if (byte >> np.uint8(t)) & np.uint8(1) else m)
        for t in range(ob.size - whole * 8):
            ob[whole * 8 + t] += a * (h if (pb[whole] >> np.uint8(t)) & np.uint8(1) else m)

@_jit
def unpack_stream(packed, n, bits, codes):  # type: ignore[no-untyped-def]
    """Codes of any width 1..8 (the little-endian bit stream of compression.bitpack)."""
    acc = np.uint64(0)
    filled = 0
    j = 0
    mask = np.uint64((1 << bits) - 1)
    for i in range(n):
        while filled < bits:
            acc |= np.uint64(packed[j]) << np.uint64(filled)
            filled += 8
            j += 1
        codes[i] = np.uint8(acc & mask)
        acc >>= np.uint64(bits)
        filled -= bits

@_jit
def affine_accumulate_codes(codes, bucket, offset, mult, alpha, out):  # type: ignore[no-untyped-def]
    off = np.float32(offset)
    a = np.float32(alpha)
    for b in range(mult.size):
        start = b * bucket
        ob = out[start : start + bucket]
        cb = codes[start : start + bucket]
        m = mult[b]
        for k in range(ob.size):
            ob[k] += a * ((np.float32(cb[k]) - off) * m)
