"""Sparsifiers: send few coordinates, their values encoded by any dense codec.

* ``topk:ratio=R`` - the ``ceil(R*n)`` largest magnitudes, exact (``torch.topk``, slow on CPU).
* ``topk:ratio=R,sample=F`` - DGC-style (Lin et al., ICLR 2018, https://arxiv.org/abs/1712.01887):
  estimate the magnitude threshold from a random fraction ``F`` of the elements, keep what passes,
  trim to at most ``ceil(R*n)`` with an exact top-k over the (few) survivors.
* ``threshold:value=T`` - every element with ``|x| >= T`` (variable size).
* ``topk:ratio=R,scope=tensor`` - the top ``R`` of *each tensor* (at least one element each), as DGC
  sparsifies layer by layer: a whole-model top-k spends its budget on the layers whose updates are
  largest (often the classifier) and starves the rest. Needs the tensor sizes (``for_model``).
* ``randk:ratio=R`` - ``ceil(R*n)`` coordinates drawn from a seed carried in the payload; no
  indices are sent. With a seed shared by all clients of a round, every client keeps the same
  support (compatible with secure aggregation). ``unbiased=true`` scales values by ``n/k``.

Composition: ``topk:ratio=0.01+qsgd:bits=4`` quantizes the kept values (SparCML's "top-k + Q4").
Body of the index-carrying sparsifiers::

    u64 k | u64 index coding << 56 | index-section length | indices | payload of the values codec (k values)

The indices are sorted and sent as gaps, delta + varint or delta + Rice, whichever is smaller for
this payload (:mod:`fedge.compression.index_sets`; Rice saves ~20% at 1% density). The coding sits
in the top byte of the length field; payloads from before Rice coding have 0 there (varint).

The values payload is a complete nested payload, validated by its own codec. Biased sparsifiers
need error feedback: the residual keeps what was not sent.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedge.compression import kernels
from fedge.compression.codec import Codec
from fedge.compression.dense import Float32Codec
from fedge.compression.errors import PayloadError, SpecError
from fedge.compression.seeds import derive_seed
from fedge.compression.index_sets import decode_index_set, encode_index_set
from fedge.compression.varint import MAX_VARINT_BYTES
from fedge.compression.wire import CODEC_IDS, HEADER_SIZE, Header, check_crc, parse_payload

__all__ = ["SCOPES", "RandomKCodec", "ThresholdCodec", "TopKCodec"]

#: where top-k ranks: over the whole update, or within each tensor (each keeps its own top ratio)
SCOPES = ("model", "tensor")

_COUNTS = struct.Struct("<QQ")
_SCHEME_SHIFT = 56


def _dense_values(values: Codec | None) -> Codec:
    """The codec of a sparsifier's kept values: fp32 by default, never another sparsifier."""
    if values is None:
        return Float32Codec()
    if isinstance(values, _SparseCodec | RandomKCodec) or values.name in ("zstd", "layerwise", "dgc"):
        raise SpecError("the values of a sparsifier must use a fixed-size dense codec (wrap the whole "
                        "sparsifier in zstd instead: zstd:level=3+topk:...)")
    return values


def _with_values(head: str, values: Codec) -> str:
    """Spec of a sparsifier: ``head``, plus ``+values`` unless the values go as fp32."""
    return head if isinstance(values, Float32Codec) else f"{head}+{values.spec}"


def _f32(value: float) -> float:
    """``value`` as it survives a float32 field of the wire format."""
    return float(np.float32(value))


class _SparseCodec(Codec):
    """Common body layout and validation of the index-carrying sparsifiers."""

    unbiased = False

    def __init__(self, values: Codec | None) -> None:
        self.values = _dense_values(values)

    def max_kept(self, numel: int) -> int:
        return numel

    def body_size(self, numel: int) -> int:
        """Upper bound: the exact size depends on the index gaps (and on k for thresholds)."""
        k = self.max_kept(numel)
        return _COUNTS.size + MAX_VARINT_BYTES * k + self.values.wire_bytes(k)

    def _check_body_length(self, header: Header) -> None:
        if header.body_length > self.body_size(header.numel):
            raise PayloadError(f"body of {header.body_length} bytes exceeds the {self.spec!r} bound")

    def _select(self, magnitude: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Sorted int64 indices of the coordinates to send, from the elements' magnitudes."""
        raise NotImplementedError

    def _fused_select(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor | None:
        """Indices from a fused kernel (which also rejects NaN/inf), or None to use :meth:`_select`."""
        return None

    @property
    def checks_finite(self) -> bool:
        return kernels.available() and type(self)._fused_select is not _SparseCodec._fused_select

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        return self._body_for(x, self._indices(x, generator), generator)

    def _indices(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Sorted indices of the elements of ``x`` to send: the fused kernel's, or :meth:`_select`'s."""
        indices = self._fused_select(x, generator) if kernels.available() else None
        if indices is None:
            if self.checks_finite and not bool(torch.isfinite(x).all()):  # the kernel declined
                raise ValueError("cannot encode a tensor with NaN or infinite values")
            indices = self._select(x.abs(), generator)
        return indices

    def _body_for(self, x: torch.Tensor, indices: torch.Tensor, generator: torch.Generator | None) -> bytes:
        """The body that sends ``x`` at the sorted ``indices``."""
        scheme, index_bytes = encode_index_set(indices.numpy())
        values = self.values.encode(x[indices], generator)
        return _COUNTS.pack(indices.numel(), scheme << _SCHEME_SHIFT | len(index_bytes)) + index_bytes + values

    def decode_into(self, payload: bytes | bytearray | memoryview, out: torch.Tensor, alpha: float = 1.0) -> None:
        """Validate everything, then add the k kept values in place: no dense temporary."""
        if out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu":
            return super().decode_into(payload, out, alpha)
        header, body = parse_payload(payload, verify_checksum=False)
        self._check_header(header, out.numel())
        check_crc(memoryview(payload).cast("B"))
        indices, values = self._indices_and_values(body, header.numel)
        if kernels.available():
            kernels.scatter_add(out.numpy(), indices, values.numpy(), alpha)
        else:
            out.index_put_((torch.from_numpy(indices),), values * alpha, accumulate=True)  # distinct indices
        return None

    def decode(self, payload: bytes | bytearray | memoryview, expected_numel: int) -> torch.Tensor:
        out = self._zeros_for(payload, expected_numel)
        self.decode_into(payload, out)
        return out

    def _indices_and_values(self, body: memoryview, numel: int) -> tuple[np.ndarray, torch.Tensor]:
        if len(body) < _COUNTS.size:
            raise PayloadError("sparse body too short for its counts")
        k, field = _COUNTS.unpack(body[: _COUNTS.size])
        scheme, index_length = field >> _SCHEME_SHIFT, field & ((1 << _SCHEME_SHIFT) - 1)
        if k > self.max_kept(numel):
            raise PayloadError(f"{k} kept elements exceed the {self.max_kept(numel)} allowed")
        if index_length > len(body) - _COUNTS.size - HEADER_SIZE:
            raise PayloadError(f"index section length {index_length} overruns the body")
        start = _COUNTS.size
        indices = decode_index_set(scheme, body[start : start + index_length], k, numel)
        values = self.values.decode(body[start + index_length :], k)
        return indices, values

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        indices, values = self._indices_and_values(body, numel)
        out = torch.zeros(numel, dtype=torch.float32)
        out[torch.from_numpy(indices)] = values
        return out

    def _params(self, value: float) -> bytes:
        return struct.pack("<fB", value, CODEC_IDS[self.values.name])

    def _spec_with_values(self, head: str) -> str:
        return _with_values(head, self.values)


class TopKCodec(_SparseCodec):
    name = "topk"

    def __init__(self, ratio: float = 0.01, sample: float = 0.0, scope: str = "model", values: Codec | None = None,
                 sizes: tuple[int, ...] | None = None) -> None:
        super().__init__(values)
        if not 0 < ratio <= 1:
            raise SpecError(f"topk ratio must be in (0, 1], got {ratio}")
        if not 0 <= sample <= 1:
            raise SpecError(f"topk sample must be in [0, 1] (0 = exact), got {sample}")
        if scope not in SCOPES:
            raise SpecError(f"topk scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        self.ratio, self.sample, self.scope, self.sizes = _f32(ratio), _f32(sample), scope, sizes

    @property
    def spec(self) -> str:
        head = f"topk:ratio={self.ratio:g}" + (f",sample={self.sample:g}" if self.sample else "")
        head += ",scope=tensor" if self.scope == "tensor" else ""
        return self._spec_with_values(head)

    def params_bytes(self) -> bytes:
        return self._params(self.ratio) + struct.pack("<f", self.sample)[:3]

    def for_model(self, sizes: list[int] | tuple[int, ...]) -> Codec:
        if self.scope != "tensor":
            return self
        return self._with(sizes=tuple(int(n) for n in sizes))

    def _with(self, **changes: object) -> TopKCodec:
        """A copy of this codec with some constructor arguments changed (DGC's rounds reuse it)."""
        args: dict[str, object] = {"ratio": self.ratio, "sample": self.sample, "scope": self.scope,
                                   "values": self.values, "sizes": self.sizes, **changes}
        return TopKCodec(**args)  # type: ignore[arg-type]

    def _tensor_sizes(self, numel: int) -> tuple[int, ...]:
        if self.scope != "tensor":
            return (numel,)
        if self.sizes is None:
            raise ValueError("topk scope=tensor used before for_model(sizes) bound the tensor sizes")
        if sum(self.sizes) != numel:
            raise PayloadError(f"topk scope=tensor is bound to {sum(self.sizes)} elements, got {numel}")
        return self.sizes

    def _kept_of(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    def max_kept(self, numel: int) -> int:
        """``ceil(ratio * n)``; per tensor, each tensor's own (so at most one more per tensor)."""
        if self.scope == "tensor" and self.sizes is not None and sum(self.sizes) == numel:
            return sum(self._kept_of(n) for n in self.sizes)
        return self._kept_of(numel)

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        if self.scope != "tensor":
            return super()._encode_body(x, generator)
        if not bool(torch.isfinite(x).all()):
            raise ValueError("cannot encode a tensor with NaN or infinite values")
        whole = self._with(scope="model", sizes=None)
        parts, offset = [], 0
        for size in self._tensor_sizes(x.numel()):
            parts.append(whole._indices(x[offset: offset + size], generator) + offset)
            offset += size
        return self._body_for(x, torch.cat(parts), generator)

    def _fused_select(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor | None:
        """Sampled top-k in one pass over ``x``: threshold from the probe, then the kernel collects
        the survivors in index order (room for 4k of them; with more it declines)."""
        n = x.numel()
        k = self._kept_of(n)
        if not self.sample or k == 0 or k >= n:
            return None
        size = min(n, max(k, math.ceil(self.sample * n), 1000))
        probe = x[torch.randint(n, (size,), generator=generator)].abs()
        threshold = float(torch.kthvalue(probe, max(1, size - math.ceil(1.2 * self.ratio * size))).values)
        found = kernels.select_above(x.numpy(), threshold, 4 * k + 64)
        if found is None:
            return None
        candidates = torch.from_numpy(found)
        if candidates.numel() > k:
            # trim to exactly the k largest while keeping index order (no sort needed)
            order = torch.topk(x[candidates].abs(), k, sorted=False).indices
            keep = torch.zeros(candidates.numel(), dtype=torch.bool)
            keep[order] = True
            candidates = candidates[keep]
        return candidates

    def _select(self, magnitude: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        k = self._kept_of(magnitude.numel())
        if k == 0:
            return torch.zeros(0, dtype=torch.long)
        if self.sample and k < magnitude.numel():
            n = magnitude.numel()
            size = min(n, max(k, math.ceil(self.sample * n), 1000))
            probe = magnitude[torch.randint(n, (size,), generator=generator)]
            # The (1 - ratio) quantile of the sample, a little lower so that we rarely fall short.
            threshold = torch.kthvalue(probe, max(1, size - math.ceil(1.2 * self.ratio * size))).values
            candidates = torch.nonzero(magnitude >= threshold).squeeze(1)
            if candidates.numel() > k:
                candidates = candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]
            return candidates.sort().values
        return torch.topk(magnitude, k, sorted=False).indices.sort().values


class ThresholdCodec(_SparseCodec):
    name = "threshold"

    def __init__(self, value: float = 1e-3, values: Codec | None = None) -> None:
        super().__init__(values)
        if not (value > 0 and math.isfinite(value)):
            raise SpecError(f"threshold value must be a positive number, got {value}")
        self.value = _f32(value)

    @property
    def spec(self) -> str:
        return self._spec_with_values(f"threshold:value={self.value:g}")

    def params_bytes(self) -> bytes:
        return self._params(self.value)

    def _select(self, magnitude: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return torch.nonzero(magnitude >= self.value).squeeze(1)


class RandomKCodec(Codec):
    """Random-k: body is ``u64 seed | values payload``; the support is regenerated from the seed."""

    name = "randk"

    def __init__(self, ratio: float = 0.01, unbiased: bool = False, seed: int = -1, shared: bool = False,
                 values: Codec | None = None) -> None:
        if not 0 < ratio <= 1:
            raise SpecError(f"randk ratio must be in (0, 1], got {ratio}")
        self.values = _dense_values(values)
        self.ratio = _f32(ratio)
        self.scale_values = bool(unbiased)
        self.unbiased = self.scale_values and self.values.unbiased  # type: ignore[misc]
        # seed >= 0: a fixed support; -1: drawn per encode; shared: one support per round, derived
        # from the run seed and the round number (see for_round), the same on every client.
        self.seed = int(seed)
        self.shared = bool(shared)

    @property
    def spec(self) -> str:
        head = f"randk:ratio={self.ratio:g}" + (",unbiased=true" if self.scale_values else "")
        head += f",seed={self.seed}" if self.seed >= 0 else ""
        head += ",shared=true" if self.shared else ""
        return _with_values(head, self.values)

    def params_bytes(self) -> bytes:
        return struct.pack("<fBB", self.ratio, CODEC_IDS[self.values.name], int(self.scale_values))

    def kept(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    def for_round(self, server_round: int, seed: int) -> Codec:
        if not self.shared:
            return self
        round_seed = derive_seed(seed, server_round, purpose="randk-support")
        return RandomKCodec(self.ratio, self.scale_values, round_seed, False, self.values)

    def body_size(self, numel: int) -> int:
        return 8 + self.values.wire_bytes(self.kept(numel))

    def support(self, numel: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randperm(numel, generator=gen)[: self.kept(numel)].sort().values

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        seed = self.seed
        if seed < 0:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        index = self.support(x.numel(), seed)
        values = x[index]
        if self.scale_values and index.numel():
            values = values * (x.numel() / index.numel())
        return struct.pack("<Q", seed) + self.values.encode(values, generator)

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        (seed,) = struct.unpack("<Q", body[:8])
        if seed >= 2**63:
            raise PayloadError(f"random-k seed {seed} out of range")
        if self.seed >= 0 and seed != self.seed:
            raise PayloadError(f"random-k seed {seed} differs from the round's seed {self.seed}")
        values = self.values.decode(body[8:], self.kept(numel))
        out = torch.zeros(numel, dtype=torch.float32)
        out[self.support(numel, seed)] = values
        return out


