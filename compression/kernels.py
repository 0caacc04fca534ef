"""Fused single-pass kernels for the bucketed quantizers, compiled with numba when it is installed.

The reference implementation of every codec is a chain of whole-array torch operations: clear, but
each step reads and writes the whole vector, so QSGD ran at ~1% of a memory copy. These kernels do
one pass per bucket instead (max, then quantize with stochastic rounding, straight to codes), pack
codes in one more pass, and decode by unpacking, scaling and accumulating into the caller's buffer
in one pass after one validation pass. They produce the same wire format, so either side may use
either implementation; the decoders give bit-identical values.

Stochastic rounding draws its uniforms from a counter-based hash (Wellons' ``lowbias32`` of
``index ^ seed``, 24-bit resolution) instead of torch's generator, which is what lets the loop
vectorize. For a uniformly random 32-bit seed, ``index ^ seed`` is uniform and the hash is a
bijection, so every element's uniform is exactly uniform (to 2^-24) and the rounding stays
unbiased; the seed is drawn from the caller's torch generator, so runs stay reproducible.

Loops index array *slices* with non-negative counters: with a computed start index numba must
handle negative wrap-around, which stops LLVM from vectorizing (measured 17 ms against 10 ms).
Set ``FEDGE_KERNELS=off`` to force the torch reference path (tests compare both). The compiled
kernels live in :mod:`fedge.compression.jit`, imported the first time a codec asks for them
(:func:`available`): a process that never encodes or decodes (the CLI's checks) never loads numba.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

__all__ = [
    "accumulate_codes",
    "available",
    "bucketed_decode_into",
    "max_code_of",
    "max_magnitude_bits",
    "pack_into",
    "qsgd_encode",
    "scatter_add",
    "select_above",
    "sign_encode",
    "terngrad_encode",
    "thread_buffer",
    "two_level_decode_into",
    "unpack",
    "varint_decode",
    "varint_encode",
]

log = logging.getLogger(__name__)


@functools.cache
def _kernels() -> types.ModuleType | None:
    """The compiled kernels (:mod:`fedge.compression.jit`), imported on first use (Python's import
    lock makes a concurrent first call wait for the same module); None where they cannot run
    (numba missing, ``FEDGE_KERNELS=off``, a big-endian host)."""
    try:
        from fedge.compression import jit
    except ImportError as err:  # pragma: no cover - exercised by the FEDGE_KERNELS=off test run
        log.debug("fused kernels unavailable (%s): using the torch reference path", err)
        return None
    return jit


def _k() -> Any:
    """The loaded kernels, for the wrappers below (each caller has checked :func:`available`)."""
    module = _kernels()
    if module is None:
        raise RuntimeError("the fused kernels are not available here; check kernels.available() first")
    return module


_reference = threading.local()


@contextlib.contextmanager
def reference_path() -> Iterator[None]:
    """Within it, this thread's codecs take the torch reference path (the same wire format; other
    stochastic-rounding draws), and numba is not loaded for them: for a one-off measurement in a
    process that may never encode otherwise (the coordinator's contractivity check)."""
    previous = getattr(_reference, "on", False)
    _reference.on = True
    try:
        yield
    finally:
        _reference.on = previous


def available() -> bool:
    return not getattr(_reference, "on", False) and _kernels() is not None


def thread_buffer(owner: object, name: str, size: int, make: Callable[[int], T]) -> T:
    """A 1-D buffer of ``size`` elements kept per thread on ``owner`` and reused across calls.

    Writing into warm pages instead of a fresh allocation saves the page faults (~1 ms per 5 MB
    here). ``make(size)`` builds it the first time and whenever the size changes.
    """
    local = owner.__dict__.setdefault("_thread_buffers", threading.local())
    buffer = getattr(local, name, None)
    if buffer is None or len(buffer) != size:
        buffer = make(size)
        setattr(local, name, buffer)
    return buffer


_MODULE_BUFFERS = types.SimpleNamespace()


def _codes_scratch(n: int) -> np.ndarray:
    """A per-thread uint8 buffer for unpacked codes."""
    return thread_buffer(_MODULE_BUFFERS, "codes", n, lambda size: np.empty(size, dtype=np.uint8))


def _split_body(body: np.ndarray, num_scales: int) -> tuple[np.ndarray, np.ndarray]:
    """The float32 scale section and the packed-code section of one body buffer (no copies)."""
    return body[: 4 * num_scales].view(np.float32), body[4 * num_scales :]


def _raise(status: int) -> None:
    if status == 1:
        raise ValueError("cannot encode a tensor with NaN or infinite values")
    if status == 2:
        raise ValueError("a bucket's L2 norm exceeds the float32 range; use norm=max")


def qsgd_encode(x: np.ndarray, bucket: int, levels: int, bits: int, l2: bool, seed: int, body: np.ndarray) -> None:
    """Write QSGD's body (scales, then packed ``levels + sign * level`` codes) into ``body``."""
    scales, packed = _split_body(body, -(-x.size // bucket))
    if 8 % bits == 0 and bucket % (8 // bits) == 0:
        status = _k().BY_BITS[bits][3](x, x.view(np.uint32), bucket, levels, l2, np.uint32(seed), scales,
                                   scales.view(np.uint32), packed)
    else:
        codes = _codes_scratch(x.size)
        status = _k().qsgd_encode(x, x.view(np.uint32), bucket, levels, l2, np.uint32(seed), scales,
                              scales.view(np.uint32), codes)
        pack_into(codes, bits, packed)
    _raise(status)


def terngrad_encode(x: np.ndarray, bucket: int, clip: float, seed: int, body: np.ndarray) -> None:
    """Write TernGrad's body (scales, then packed 2-bit ``1 + sign * kept`` codes) into ``body``."""
    scales, packed = _split_body(body, -(-x.size // bucket))
    codes = _codes_scratch(x.size)
    _raise(_k().terngrad_encode(x, x.view(np.uint32), bucket, clip, np.uint32(seed), scales, codes))
    pack_into(codes, 2, packed)


def sign_encode(x: np.ndarray, bucket: int, two_sided: bool, body: np.ndarray) -> None:
    """Write the body of scaled sign (mean |x|) or 1-bit (two side means) and the sign bits."""
    scales, packed = _split_body(body, -(-x.size // bucket) * (2 if two_sided else 1))
    codes = _codes_scratch(x.size)
    _raise(_k().sign_encode(x, x.view(np.uint32), bucket, two_sided, scales, codes))
    pack_into(codes, 1, packed)


def pack_into(codes: np.ndarray, bits: int, packed: np.ndarray) -> None:
    """Pack codes into ``packed`` in the layout of :func:`compression.bitpack.pack`."""
    if bits == 8:
        packed[:] = codes
    elif 8 % bits == 0:
        _k().BY_BITS[bits][2](codes, packed)
    else:
        _k().pack_stream(codes, bits, packed)


def select_above(x: np.ndarray, threshold: float, capacity: int) -> np.ndarray | None:
    """Sorted int64 indices of ``|x| >= threshold`` (at most ``capacity``; None if more)."""
    out = np.empty(max(capacity, 1), dtype=np.int64)
    bits = np.array([abs(threshold)], dtype=np.float32).view(np.uint32)[0]
    count = _k().select_above(x.view(np.uint32), bits, out)
    if count == -2:
        raise ValueError("cannot encode a tensor with NaN or infinite values")
    return None if count == -1 else out[:count]


def varint_encode(indices: np.ndarray) -> bytes:
    out = np.empty(indices.size * 6, dtype=np.uint8)
    written = _k().varint_encode(np.ascontiguousarray(indices, dtype=np.int64), out)
    if written == -1:
        raise ValueError("indices must be non-negative and strictly increasing")
    if written == -2:
        raise ValueError("index gap too large for the varint format")
    return out[:written].tobytes()


_VARINT_ERRORS = {
    -1: "index section ends inside a varint",
    -2: "index section holds a different number of varints than declared",
    -3: "a varint is longer than the format allows",
    -4: "indices are not strictly increasing",
}


def varint_decode(raw: np.ndarray, count: int, limit: int) -> np.ndarray:
    """Indices from exactly ``raw`` (raises ValueError with the reason; the caller wraps it)."""
    out = np.empty(count, dtype=np.int64)
    status = _k().varint_decode(raw, count, limit, out)
    if status == -5:
        raise ValueError(f"an index is out of range 0..{limit - 1}")
    if status:
        raise ValueError(_VARINT_ERRORS[status])
    return out


def scatter_add(out: np.ndarray, indices: np.ndarray, values: np.ndarray, alpha: float) -> None:
    """``out[indices] += alpha * values`` for distinct, validated indices."""
    _k().scatter_add(out, indices, values, alpha)


def max_magnitude_bits(raw: np.ndarray) -> int:
    """Largest magnitude bit pattern of a uint16/uint32 view of floats (order equals value order)."""
    mask = np.uint32(0x7FFFFFFF) if raw.dtype == np.uint32 else np.uint16(0x7FFF)
    return int(_k().max_magnitude_bits(raw, mask)) if raw.size else 0


def max_code_of(packed: np.ndarray, n: int, bits: int) -> int:
    """Largest of the ``n`` packed codes (bits dividing 8)."""
    return int(_k().BY_BITS[bits][0](packed, n))


def bucketed_decode_into(
    packed: np.ndarray, n: int, bits: int, bucket: int, offset: float, mult: np.ndarray, alpha: float,
    out: np.ndarray,
) -> None:
    """``out += alpha * (code - offset) * mult[bucket]`` from packed codes of a width dividing 8;
    the codes must have been validated (:func:`max_code_of`)."""
    _k().BY_BITS[bits][1](packed, n, bucket, offset, mult, alpha, out)


def two_level_decode_into(packed: np.ndarray, bucket: int, hi: np.ndarray, lo: np.ndarray, alpha: float,
                          out: np.ndarray) -> bool:
    """1-bit codes decoded as ``hi`` (bit set) or ``-lo`` per bucket; False if ``bucket % 8``."""
    if bucket % 8:
        return False
    _k().two_level_accumulate(packed, bucket, hi, lo, alpha, out)
    return True


def accumulate_codes(codes: np.ndarray, bucket: int, offset: float, mult: np.ndarray, alpha: float,
                     out: np.ndarray) -> None:
    """The same from unpacked (validated) codes: for widths that do not divide 8."""
    _k().affine_accumulate_codes(codes, bucket, offset, mult, alpha, out)


def unpack(packed: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Same result as :func:`compression.bitpack.unpack`; ``packed`` must hold enough bytes."""
    if packed.size != (n * bits + 7) // 8:
        raise ValueError(f"expected {(n * bits + 7) // 8} packed bytes, got {packed.size}")
    codes = np.empty(n, dtype=np.uint8)
    _k().unpack_stream(packed, n, bits, codes)
    return codes
