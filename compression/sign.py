"""One bit per element: 1-bit SGD with mean reconstruction, and scaled sign (EF-SignSGD).

* ``onebit`` - Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
  Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014: per bucket the positive and
  the negative elements are each reconstructed as their own mean (two scales per bucket).
* ``sign`` - Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
  Schemes", ICML 2019, https://arxiv.org/abs/1901.09847: ``(|p|_1 / d) * sign(p)`` per bucket.

Both are biased and need error feedback (the edge client applies it by default).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from fedge.compression.bucketed import BucketedCodec

__all__ = ["OneBitCodec", "ScaledSignCodec"]


class OneBitCodec(BucketedCodec):
    name = "onebit"
    unbiased = False
    bits = 1
    max_code = 1
    scales_per_bucket = 2  # mean of the non-negative side, mean magnitude of the negative side

    def __init__(self, bucket: int = 512) -> None:
        super().__init__(bucket)

    @property
    def spec(self) -> str:
        return f"onebit:bucket={self.bucket}"

    def params_bytes(self) -> bytes:
        return struct.pack("<I", self.bucket)

    def _quantize(self, v, valid, generator):  # type: ignore[no-untyped-def]
        positive = (v >= 0) & valid
        negative = (v < 0) & valid
        pos_mean = (v * positive).sum(dim=1) / positive.sum(dim=1).clamp_min(1)
        neg_mean = -(v * negative).sum(dim=1) / negative.sum(dim=1).clamp_min(1)
        return torch.stack([pos_mean, neg_mean], dim=1), (v >= 0).to(torch.uint8)

    def _dequantize(self, scales, codes):  # type: ignore[no-untyped-def]
        return torch.where(codes.bool(), scales[:, :1], -scales[:, 1:])

    def _fused_encode(self, x, generator, body):  # type: ignore[no-untyped-def]
        from fedge.compression import kernels

        kernels.sign_encode(x, self.bucket, True, body)
        return True

    def _decode_two_level(self, scales):  # type: ignore[no-untyped-def]
        pairs = scales.astype(np.float32).reshape(-1, 2)
        return np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])


class ScaledSignCodec(BucketedCodec):
    name = "sign"
    unbiased = False
    bits = 1
    max_code = 1

    def __init__(self, bucket: int = 512) -> None:
        super().__init__(bucket)

    @property
    def spec(self) -> str:
        return f"sign:bucket={self.bucket}"

    def params_bytes(self) -> bytes:
        return struct.pack("<I", self.bucket)

    def _quantize(self, v, valid, generator):  # type: ignore[no-untyped-def]
        scale = v.abs().sum(dim=1) / valid.sum(dim=1).clamp_min(1)
        return scale, (v >= 0).to(torch.uint8)

    def _dequantize(self, scales, codes):  # type: ignore[no-untyped-def]
        return torch.where(codes.bool(), scales, -scales)

    def _fused_encode(self, x, generator, body):  # type: ignore[no-untyped-def]
        from fedge.compression import kernels

        kernels.sign_encode(x, self.bucket, False, body)
        return True

    def _decode_affine(self, scales):  # type: ignore[no-untyped-def]
        # (code - 0.5) * 2s is exactly +-s: scaling by powers of two is exact in float32
        with np.errstate(over="ignore"):
            mult = scales.astype(np.float32) * np.float32(2)
        return (0.5, mult) if np.isfinite(mult).all() else None
