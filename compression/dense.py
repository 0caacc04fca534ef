"""Dense float codecs: fp32 (``none``, the uncompressed baseline) and fp16."""

from __future__ import annotations

import numpy as np
import torch

from compression.codec import Codec

__all__ = ["Float16Codec", "Float32Codec"]


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

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        limit = float(np.finfo(self._dtype).max)
        return x.numpy().clip(-limit, limit).astype(self._dtype).tobytes()

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
