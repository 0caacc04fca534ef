"""Bucketed scalar quantizers: per bucket a few float32 scales, per element a short code.

QSGD, TernGrad, 1-bit (Seide) and scaled sign all share one body layout::

    ceil(n / bucket) x scales_per_bucket   float32 scales (finite, and >= 0 unless stated)
    n x bits                               bit-packed codes, each <= max_code

so they share one validating decoder: a subclass only says how a bucket becomes scales and codes and
back. The padding of the last bucket is masked out of every statistic (mean, norm, sigma).
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from compression import bitpack
from compression.codec import Codec
from compression.errors import PayloadError, SpecError

__all__ = ["BucketedCodec"]

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)


class BucketedCodec(Codec):
    bits: int
    bucket: int
    scales_per_bucket: int = 1
    max_code: int

    def __init__(self, bucket: int) -> None:
        if not 1 <= bucket <= 1 << 24:
            raise SpecError(f"{self.name} bucket must be in 1..{1 << 24}, got {bucket}")
        self.bucket = bucket

    def num_buckets(self, numel: int) -> int:
        return -(-numel // self.bucket)

    def body_size(self, numel: int) -> int:
        return 4 * self.scales_per_bucket * self.num_buckets(numel) + bitpack.packed_size(numel, self.bits)

    @abstractmethod
    def _quantize(
        self, v: torch.Tensor, valid: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``v`` is (buckets, bucket) float32 zero-padded, ``valid`` a bool mask of real elements.
        Return float32 scales (buckets, scales_per_bucket) and integer codes (buckets, bucket)."""

    @abstractmethod
    def _dequantize(self, scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Inverse map: float32 values (buckets, bucket) from validated scales and codes."""

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        n = x.numel()
        nb = self.num_buckets(n)
        padded = torch.zeros(nb * self.bucket, dtype=torch.float32)
        padded[:n] = x
        # Only the last bucket can hold padding: mark it there instead of comparing n indices.
        valid = torch.ones(nb, self.bucket, dtype=torch.bool)
        if nb:
            valid[-1, n - (nb - 1) * self.bucket :] = False
        scales, codes = self._quantize(padded.view(nb, self.bucket), valid, generator)
        scales = scales.reshape(nb, self.scales_per_bucket).to(torch.float32)
        if not bool(torch.isfinite(scales).all()):
            raise ValueError(f"{self.name}: a bucket scale overflows float32; the update is too large")
        packed = bitpack.pack(codes.reshape(-1)[:n].to(torch.uint8).numpy(), self.bits)
        return scales.numpy().astype("<f4").tobytes() + packed

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        nb = self.num_buckets(numel)
        scale_bytes = 4 * self.scales_per_bucket * nb
        scales = np.frombuffer(body[:scale_bytes], dtype="<f4")
        if not np.isfinite(scales).all():
            raise PayloadError("a bucket scale is NaN or infinite")
        if (scales < 0).any():
            raise PayloadError("a bucket scale is negative")
        codes = bitpack.unpack(body[scale_bytes:], numel, self.bits)
        if numel and int(codes.max()) > self.max_code:
            raise PayloadError(f"quantized code {int(codes.max())} out of range 0..{self.max_code}")
        padded = torch.zeros(nb * self.bucket, dtype=torch.uint8)
        padded[:numel] = torch.from_numpy(codes)
        scale_t = torch.from_numpy(scales.astype(np.float32)).view(nb, self.scales_per_bucket)
        return self._dequantize(scale_t, padded.view(nb, self.bucket)).reshape(-1)[:numel]
