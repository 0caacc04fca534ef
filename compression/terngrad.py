"""TernGrad: stochastic ternary quantization with gradient clipping.

Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning",
NeurIPS 2017, https://arxiv.org/abs/1705.07878

Per bucket (the paper uses a layer; a bucket keeps one outlier from flattening a whole model):
clip to ``+-clip * sigma``, take ``s = max|g|``, send ``s`` and ``sign(g) * b`` with
``b ~ Bernoulli(|g| / s)``: 2 bits per element. Unbiased for the clipped vector; ``clip=0`` turns
clipping off and makes it unbiased for the input itself.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from fedge.compression.bucketed import F32_TINY, BucketedCodec
from fedge.compression.errors import SpecError

__all__ = ["TernGradCodec"]


class TernGradCodec(BucketedCodec):
    name = "terngrad"
    bits = 2
    max_code = 2

    def __init__(self, bucket: int = 4096, clip: float = 2.5) -> None:
        super().__init__(bucket)
        if clip < 0:
            raise SpecError(f"terngrad clip must be >= 0 (0 = off), got {clip}")
        self.clip = float(struct.unpack("<f", struct.pack("<f", clip))[0])  # as sent on the wire
        self.unbiased = clip == 0  # type: ignore[misc]

    @property
    def spec(self) -> str:
        return f"terngrad:bucket={self.bucket},clip={self.clip:g}"

    def params_bytes(self) -> bytes:
        return struct.pack("<fI", self.clip, self.bucket)

    def _quantize(self, v, valid, generator):  # type: ignore[no-untyped-def]
        if self.clip > 0:
            count = valid.sum(dim=1).clamp_min(1)
            mean = v.sum(dim=1) / count
            var = ((v - mean[:, None]).pow(2) * valid).sum(dim=1) / count
            bound = (self.clip * var.sqrt())[:, None]
            v = torch.maximum(torch.minimum(v, bound), -bound)
        scales = v.abs().amax(dim=1)
        keep = torch.rand(v.shape, generator=generator) < v.abs() / scales.clamp_min(F32_TINY)[:, None]
        return scales, torch.sign(v) * keep + 1

    def _dequantize(self, scales, codes):  # type: ignore[no-untyped-def]
        return (codes.to(torch.float32) - 1).mul_(scales)

    def _fused_encode(self, x, generator, body):  # type: ignore[no-untyped-def]
        from fedge.compression import kernels

        seed = int(torch.randint(0, 2**32, (1,), generator=generator, dtype=torch.int64))
        kernels.terngrad_encode(x, self.bucket, self.clip, seed, body)
        return True

    def _decode_affine(self, scales):  # type: ignore[no-untyped-def]
        return 1.0, scales.astype(np.float32)
