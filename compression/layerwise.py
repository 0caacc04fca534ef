"""Per-tensor policy: small tensors (biases, norms) go through a cheap lossless-ish codec, large ones
through the main codec.

Spec: ``layerwise:min=1024,small=none+qsgd:bits=4`` - tensors with fewer than ``min`` elements use
``small`` (``none``, ``fp16`` or ``bf16``), the others the codec after ``+``. Compressing a 10-element
bias with a 512-bucket quantizer saves nothing and costs accuracy; sending it as fp32 costs a few
bytes, and those bytes are counted like any others.

The policy needs the model's tensor sizes, which are not part of the spec: :meth:`for_model` binds
them (the coordinator and the clients derive them from the same task). Body::

    u64 length of the small-tensor payload | small payload | large payload

each a complete nested payload over the concatenated elements of its tensors, in model order.
"""

from __future__ import annotations

import struct

import torch

from fedge.compression.codec import Codec
from fedge.compression.errors import PayloadError, SpecError
from fedge.compression.wire import CODEC_IDS, HEADER_SIZE, Header

__all__ = ["LayerwiseCodec"]

_SMALL = ("none", "fp16", "bf16")


class LayerwiseCodec(Codec):
    name = "layerwise"
    unbiased = False

    def __init__(self, min: int = 1024, small: str = "none", values: Codec | None = None,  # noqa: A002
                 sizes: tuple[int, ...] | None = None) -> None:
        from fedge.compression.registry import make_codec

        if min < 1:
            raise SpecError(f"layerwise min must be >= 1, got {min}")
        if small not in _SMALL:
            raise SpecError(f"layerwise small must be one of {_SMALL}, got {small!r}")
        if values is None:
            raise SpecError("layerwise needs the codec for large tensors after '+', e.g. layerwise:min=1024+qsgd:bits=4")
        self.min, self.small_name = min, small
        self.small = make_codec(small)
        self.large = values
        self.sizes = sizes
        self.unbiased = self.small.unbiased and self.large.unbiased  # type: ignore[misc]

    @property
    def spec(self) -> str:
        return f"layerwise:min={self.min},small={self.small_name}+{self.large.spec}"

    def params_bytes(self) -> bytes:
        return struct.pack("<IBB", self.min, CODEC_IDS[self.small.name], CODEC_IDS[self.large.name])

    def for_model(self, sizes: list[int] | tuple[int, ...]) -> LayerwiseCodec:
        return LayerwiseCodec(self.min, self.small_name, self.large, tuple(int(n) for n in sizes))

    def for_round(self, server_round: int, seed: int) -> Codec:
        return LayerwiseCodec(self.min, self.small_name, self.large.for_round(server_round, seed), self.sizes)

    def _masks(self, numel: int) -> torch.Tensor:
        if self.sizes is None:
            raise ValueError("layerwise codec used before for_model(sizes) bound the tensor sizes")
        if sum(self.sizes) != numel:
            raise PayloadError(f"layerwise codec bound to {sum(self.sizes)} elements, got {numel}")
        return torch.cat([torch.full((n,), n < self.min, dtype=torch.bool) for n in self.sizes])

    def body_size(self, numel: int) -> int:
        small = int(self._masks(numel).sum())
        return 8 + self.small.wire_bytes(small) + self.large.wire_bytes(numel - small)

    def _check_body_length(self, header: Header) -> None:
        if header.body_length > self.body_size(header.numel):
            raise PayloadError(f"body of {header.body_length} bytes exceeds the {self.spec!r} bound")

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        is_small = self._masks(x.numel())
        small = self.small.encode(x[is_small], generator)
        large = self.large.encode(x[~is_small], generator)
        return struct.pack("<Q", len(small)) + small + large

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        is_small = self._masks(numel)
        (small_length,) = struct.unpack("<Q", body[:8])
        if small_length > len(body) - 8 - HEADER_SIZE:
            raise PayloadError(f"small-tensor payload length {small_length} overruns the body")
        out = torch.empty(numel, dtype=torch.float32)
        count = int(is_small.sum())
        out[is_small] = self.small.decode(body[8 : 8 + small_length], count)
        out[~is_small] = self.large.decode(body[8 + small_length :], numel - count)
        return out
