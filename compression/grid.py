"""Fixed-range stochastic quantization on a grid every client shares: ``grid:bits=8,clip=0.1``.

Each element is clipped to [-clip, clip] and rounded stochastically (unbiased inside the range) onto
the same 2^bits levels on every client, whatever its own magnitudes: the codec a sum can be taken of,
level by level. It is the quantizer secure aggregation uses (``fedge.privacy.shared_grid``), sent
here in clear: the baseline that isolates what masking costs. Clipping is biased; error feedback
(on by default) resends what it cut. Per bucket, the scale slot carries ``clip`` (the bucketed layout's
scales), so a decoder needs nothing beyond the payload.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedge.compression.bucketed import BucketedCodec
from fedge.compression.errors import SpecError
from fedge.compression.qsgd import stochastic_round

__all__ = ["GridCodec"]

_PARAMS = struct.Struct("<BxxxI")  # bits, pad, bucket


class GridCodec(BucketedCodec):
    name = "grid"
    unbiased = False  # clipping; unbiased for elements inside [-clip, clip]

    def __init__(self, bits: int = 8, clip: float = 0.1, bucket: int = 4096) -> None:
        super().__init__(bucket)
        if not 1 <= bits <= 8:
            raise SpecError(f"grid bits must be in 1..8, got {bits}")
        if not (math.isfinite(clip) and clip > 0):
            raise SpecError(f"grid clip must be a positive number, got {clip}")
        self.bits = bits
        self.clip = float(np.float32(clip))
        self.max_code = (1 << bits) - 1

    @property
    def spec(self) -> str:
        return f"grid:bits={self.bits},clip={self.clip:g},bucket={self.bucket}"

    def params_bytes(self) -> bytes:
        return _PARAMS.pack(self.bits, self.bucket)

    def _quantize(self, v, valid, generator):  # type: ignore[no-untyped-def]
        scales = torch.full((v.shape[0],), self.clip, dtype=torch.float32)
        position = v.clamp(-self.clip, self.clip).add_(self.clip).mul_(self.max_code / (2 * self.clip))
        return scales, stochastic_round(position, generator).clamp_(0, self.max_code)

    def _dequantize(self, scales, codes):  # type: ignore[no-untyped-def]
        # (code - top/2) * (clip * 2/top): the same float32 operations as the fused affine decode
        step = scales * torch.tensor(2 / self.max_code, dtype=torch.float32)
        return codes.to(torch.float32).sub_(self.max_code / 2).mul_(step)

    def _decode_affine(self, scales):  # type: ignore[no-untyped-def]
        return self.max_code / 2, (scales.astype(np.float32) * np.float32(2 / self.max_code)).astype(np.float32)
