"""Dense float codecs: fp32 (``none``, the uncompressed baseline) and fp16."""

from __future__ import annotations

import numpy as np
import torch

from compression.codec import Codec

__all__ = ["Float32Codec", "Float16Codec"]

_FP16_MAX = float(np.finfo(np.float16).max)


class Float32Codec(Codec):
    """Raw little-endian float32: the baseline every compression ratio is measured against."""

    name = "none"
    unbiased = True

    @property
    def spec(self) -> str:
        return "none"

    def params_bytes(self) -> bytes:
        return bytes(8)

    def body_size(self, numel: int) -> int:
        return 4 * numel

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        return x.numpy().astype("<f4", copy=False).tobytes()

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(body, dtype="<f4").astype(np.float32))


class Float16Codec(Codec):
    """IEEE half precision, round to nearest; values beyond ±65504 are clamped, not sent as inf.

    Round-to-nearest is biased, which is why the edge client wraps it in error feedback like any
    other lossy codec; the clamped excess also lands in the residual rather than being lost.
    """

    name = "fp16"
    unbiased = False

    @property
    def spec(self) -> str:
        return "fp16"

    def params_bytes(self) -> bytes:
        return bytes(8)

    def body_size(self, numel: int) -> int:
        return 2 * numel

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        return x.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).numpy().astype("<f2").tobytes()

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(body, dtype="<f2").astype(np.float32))
