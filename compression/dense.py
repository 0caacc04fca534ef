"""Dense float codecs: fp32 (``none``, the uncompressed baseline), fp16 and bf16."""

from __future__ import annotations

import numpy as np
import torch

from compression.codec import Codec

__all__ = ["BFloat16Codec", "Float16Codec", "Float32Codec"]


class _DenseCodec(Codec):
    """Every element as one little-endian float of ``_dtype``; values beyond its range are clamped."""

    _dtype: np.dtype

    @property
    def spec(self) -> str:
        return self.name

    def params_bytes(self) -> bytes:
        return bytes(8)

    def body_size(self, numel: int) -> int:
        return self._dtype.itemsize * numel

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> memoryview:
        values = x.numpy()
        if self._dtype.itemsize < 4:  # narrower than float32: clamp instead of overflowing to inf
            limit = float(np.finfo(self._dtype).max)
            values = np.clip(values, -limit, limit)
        return memoryview(values.astype(self._dtype, copy=False)).cast("B")

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(body, dtype=self._dtype).astype(np.float32))


class Float32Codec(_DenseCodec):
    """Raw float32: the baseline every compression ratio is measured against."""

    name = "none"
    unbiased = True
    _dtype = np.dtype("<f4")


class Float16Codec(_DenseCodec):
    """IEEE half precision, round to nearest; values beyond +-65504 are clamped, not sent as inf.

    Round-to-nearest is biased, which is why the edge client wraps it in error feedback like any
    other lossy codec; the clamped excess also lands in the residual rather than being lost.
    """

    name = "fp16"
    unbiased = False
    _dtype = np.dtype("<f2")


class BFloat16Codec(Codec):
    """bfloat16 (8-bit exponent, 7-bit mantissa), round to nearest even as torch converts.

    Same range as float32, so nothing is clamped; the coarse mantissa (relative error <= 2^-8) is
    biased, hence error feedback as for fp16. Sent as the upper 16 bits of each float32, little-endian.
    """

    name = "bf16"
    unbiased = False

    @property
    def spec(self) -> str:
        return "bf16"

    def params_bytes(self) -> bytes:
        return bytes(8)

    def body_size(self, numel: int) -> int:
        return 2 * numel

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        half = x.to(torch.bfloat16)
        if not bool(torch.isfinite(half).all()):  # values within 2^-8 of float32's max round to inf
            half = x.clamp(-3.38e38, 3.38e38).to(torch.bfloat16)
        return half.view(torch.int16).numpy().astype("<i2").tobytes()

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        raw = torch.from_numpy(np.frombuffer(body, dtype="<i2").astype(np.int16))
        return raw.view(torch.bfloat16).to(torch.float32)
