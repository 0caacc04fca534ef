"""Time-correlated sparsification: the update's values on a support both sides already know.

Ozfatura, Ozfatura and Gunduz, "Time-Correlated Sparsification for Communication-Efficient
Federated Learning", ISIT 2021, https://arxiv.org/abs/2101.08837

Top-k uplinks spend most of their bytes on *where* the values go (about 8 bits of index per 4-bit
value at 2% density), and ten clients' top-k supports barely overlap, so their mean is several
times denser than any one of them and a sparse downlink can carry only part of it. The coordinates
that matter move slowly from round to round: the support of the model's last change (what the
downlink just sent, which every node received and the coordinator sent) is a good guess of where
this round's update is large. So a node sends

* its update's values on that *shared support*, without indices, and
* its own top ``extra`` fraction of the coordinates outside it, with indices (what the shared
  support missed: without them a coordinate outside it would never move),

all values through one values codec (``+qsgd:bits=4``). Error feedback keeps what was not sent.
Every node of a round that received the same change sends on the same support, so their mean is
about as sparse as one of them and the next change can carry it.

The support is side information: the codec is bound to it (:meth:`SharedSupportCodec.with_support`)
by both sides, from the same downlink message. The payload carries the support's size and a CRC
of it, so a node and a coordinator that disagree about it get a :class:`PayloadError`, never a
mis-decoded update. Unbound (no shared support known, e.g. after a snapshot), the codec sends the
extras alone, a sampled top-k.

Spec: ``tcs:extra=0.01,sample=0.05[+qsgd:bits=4]``. Body::

    u64 support size | u32 support crc32 | u32 extras | u64 index coding << 56 | index length
    | extra indices | values payload (support values, then extra values)
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import torch

from fedge.compression.codec import Codec
from fedge.compression.errors import PayloadError, SpecError
from fedge.compression.index_sets import decode_index_set, encode_index_set
from fedge.compression.sparse import TopKCodec, _dense_values, _f32, _with_values
from fedge.compression.varint import MAX_VARINT_BYTES
from fedge.compression.wire import CODEC_IDS, HEADER_SIZE, Header

__all__ = ["SharedSupportCodec", "support_digest"]

_HEAD = struct.Struct("<QIIQ")
_SCHEME_SHIFT = 56
_NO_SUPPORT = np.zeros(0, dtype=np.int64)


def support_digest(support: np.ndarray) -> int:
    """CRC-32 of a support's indices (int64, little-endian): what a payload names its support by."""
    return zlib.crc32(np.ascontiguousarray(support, dtype="<i8").tobytes())


class SharedSupportCodec(Codec):
    """Values on a shared support plus the top ``extra`` outside it (see the module docstring)."""

    name = "tcs"
    unbiased = False
    shares_support = True

    def __init__(self, extra: float = 0.01, sample: float = 0.05, values: Codec | None = None,
                 support: np.ndarray | None = None) -> None:
        if not 0 < extra <= 1:
            raise SpecError(f"tcs extra must be in (0, 1], got {extra}")
        if not 0 <= sample <= 1:
            raise SpecError(f"tcs sample must be in [0, 1] (0 = exact), got {sample}")
        self.values = _dense_values(values)
        self.extra, self.sample = _f32(extra), _f32(sample)
        self.support = _NO_SUPPORT if support is None else _checked(support)
        self._digest = support_digest(self.support)

    @property
    def spec(self) -> str:
        return _with_values(f"tcs:extra={self.extra:g},sample={self.sample:g}", self.values)

    def params_bytes(self) -> bytes:
        """extra (f32), the values codec's id, sample (f32 without its lowest mantissa byte): 8 bytes.
        (Packed as f32, f32, id, the id fell past the field's end.)"""
        return struct.pack("<fB", self.extra, CODEC_IDS[self.values.name]) + struct.pack("<f", self.sample)[1:]

    def with_support(self, support: np.ndarray | None) -> SharedSupportCodec:
        """This codec bound to ``support`` (sorted, distinct indices; None or empty: none)."""
        return SharedSupportCodec(self.extra, self.sample, self.values, support)

    def extras_of(self, numel: int) -> int:
        """At most ``ceil(extra * n)`` coordinates outside the support, never more than there are."""
        outside = numel - self.support.size
        return min(outside, max(1, math.ceil(self.extra * numel))) if outside > 0 else 0

    def body_size(self, numel: int) -> int:
        """Upper bound: the extras' index coding depends on their gaps."""
        extras = self.extras_of(numel)
        return _HEAD.size + MAX_VARINT_BYTES * extras + self.values.wire_bytes(self.support.size + extras)

    def _check_body_length(self, header: Header) -> None:
        """Against the bound for any support (a payload sent on another support is refused by name, in
        :meth:`_parts`, not as an overlong body)."""
        n = header.numel
        bound = _HEAD.size + MAX_VARINT_BYTES * math.ceil(self.extra * n) + self.values.wire_bytes(n)
        if header.body_length > bound:
            raise PayloadError(f"body of {header.body_length} bytes exceeds the {self.spec!r} bound")

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        n = x.numel()
        support = self._fitting(n)
        outside = x.clone()
        index = torch.from_numpy(support)
        outside[index] = 0.0
        extras = self.extras_of(n)
        chosen = _NO_SUPPORT
        if extras:
            chosen = TopKCodec(ratio=self.extra, sample=self.sample)._indices(outside, generator).numpy()
            chosen = np.setdiff1d(chosen, support, assume_unique=True)  # a zero in the support, picked in a tie
            if chosen.size > extras:  # few coordinates left outside the support: the largest of them
                top = torch.topk(outside[torch.from_numpy(chosen)].abs(), extras, sorted=False).indices
                chosen = np.sort(chosen[top.numpy()])
        scheme, index_bytes = encode_index_set(chosen)
        both = torch.cat([x[index], x[torch.from_numpy(chosen)]])
        head = _HEAD.pack(support.size, self._digest, chosen.size, scheme << _SCHEME_SHIFT | len(index_bytes))
        return head + index_bytes + self.values.encode(both, generator)

    def _parts(self, body: memoryview, numel: int) -> tuple[np.ndarray, torch.Tensor]:
        """(indices, values) of a body: the support's, then the extras'; checked against the bound support."""
        if len(body) < _HEAD.size:
            raise PayloadError("tcs body too short for its counts")
        size, digest, extras, field = _HEAD.unpack(body[: _HEAD.size])
        support = self._fitting(numel)
        if size != support.size or digest != self._digest:
            raise PayloadError(f"the update was sent on a shared support of {size} coordinates (crc {digest:08x}); "
                               f"this side holds {support.size} (crc {self._digest:08x}): they did not get the "
                               "same downlink")
        if extras > self.extras_of(numel):
            raise PayloadError(f"{extras} extra coordinates exceed the {self.extras_of(numel)} allowed")
        scheme, length = field >> _SCHEME_SHIFT, field & ((1 << _SCHEME_SHIFT) - 1)
        if length > len(body) - _HEAD.size - HEADER_SIZE:
            raise PayloadError(f"index section length {length} overruns the body")
        chosen = decode_index_set(scheme, body[_HEAD.size: _HEAD.size + length], extras, numel)
        if np.intersect1d(chosen, support, assume_unique=True).size:
            raise PayloadError("an extra coordinate lies inside the shared support")
        values = self.values.decode(body[_HEAD.size + length:], support.size + extras)
        return np.concatenate([support, chosen]), values

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        indices, values = self._parts(body, numel)
        out = torch.zeros(numel, dtype=torch.float32)
        out[torch.from_numpy(indices)] = values
        return out

    def _fitting(self, numel: int) -> np.ndarray:
        if self.support.size and int(self.support[-1]) >= numel:
            raise PayloadError(f"the shared support reaches index {int(self.support[-1])}, the update has {numel}")
        return self.support


def _checked(support: np.ndarray) -> np.ndarray:
    s = np.asarray(support).reshape(-1)
    if s.size and not np.issubdtype(s.dtype, np.integer):
        raise ValueError("a shared support must be integer indices")
    s = s.astype(np.int64)
    if s.size and (int(s[0]) < 0 or bool((np.diff(s) <= 0).any())):
        raise ValueError("a shared support must be strictly increasing, non-negative indices")
    return s
