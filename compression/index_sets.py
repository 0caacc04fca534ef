"""Sorted index sets on the wire: delta + varint or delta + Rice, whichever is smaller.

A sparse payload spends most of its bytes on *where* its values go. Varints
(:mod:`fedge.compression.varint`) are byte-aligned and fast; Rice codes (:mod:`fedge.compression.rice`)
reach the entropy of the gaps: 8.2 bits per index at 1% density against the varint's 10.3, 3.0
against 8.0 at 30% (a catch-up over many versions). The encoder measures both sizes and sends the
smaller; the scheme travels with the section, so a decoder reads either.

Rice section: ``k u8 | Rice codes of the gaps`` where the first gap is the first index and every
later gap is ``index[i] - index[i-1] - 1`` (>= 0, as indices strictly increase).
"""

from __future__ import annotations

import numpy as np

from fedge.compression import rice
from fedge.compression.errors import PayloadError
from fedge.compression.varint import decode_indices, encode_indices

__all__ = ["RICE", "SCHEMES", "VARINT", "decode_index_set", "encode_index_set"]

VARINT = 0
RICE = 1
SCHEMES = (VARINT, RICE)


def _gaps(indices: np.ndarray) -> np.ndarray:
    gaps = np.diff(indices, prepend=-1) - 1
    return gaps.astype(np.uint64)


def encode_index_set(indices: np.ndarray) -> tuple[int, bytes]:
    """(scheme, bytes) of strictly increasing non-negative ``indices``: the smaller encoding."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    varint = encode_indices(idx)  # validates order and sign
    if idx.size == 0:
        return VARINT, varint
    gaps = _gaps(idx)
    k = rice.best_parameter(gaps)
    if 1 + rice.encoded_size(gaps, k) >= len(varint):
        return VARINT, varint
    return RICE, bytes([k]) + rice.encode(gaps, k)


def decode_index_set(scheme: int, data: bytes | memoryview, count: int, limit: int) -> np.ndarray:
    """Decode ``count`` strictly increasing indices, each ``< limit``, from exactly ``data``."""
    if scheme == VARINT:
        return decode_indices(data, count, limit)
    if scheme != RICE:
        raise PayloadError(f"unknown index coding scheme {scheme}")
    raw = np.frombuffer(data, dtype=np.uint8)
    if count == 0:
        if raw.size:
            raise PayloadError("index section has bytes but no index is declared")
        return np.zeros(0, dtype=np.int64)
    if raw.size < 1:
        raise PayloadError("Rice index section lacks its parameter byte")
    gaps = rice.decode(raw[1:], count, int(raw[0]))
    if float(gaps.sum(dtype=np.float64)) + count > limit:  # also keeps the running sum in int64
        raise PayloadError(f"an index is out of range 0..{limit - 1}")
    indices = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if int(indices[-1]) >= limit:
        raise PayloadError(f"an index is out of range 0..{limit - 1}")
    return indices
