"""A codec from outside Fedge: symmetric 8-bit quantization with one scale per update.

Registered with a wire id from the range Fedge reserves for user codecs (200-254): every payload
carries the id, and every process of the run (the coordinator and each device) must load this
module, through ``plugins = "int8_codec"`` or an installed ``fedge.plugins`` entry point. Payload:
Fedge's 40-byte header, a float32 scale, one int8 per value. Use it as ``codec = "int8sym"``.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from fedge.compression import Codec, PayloadError, register_codec

CODEC_ID = 200


class Int8SymmetricCodec(Codec):
    name = "int8sym"
    unbiased = False  # deterministic rounding: error feedback keeps what is rounded away

    @property
    def spec(self) -> str:
        return "int8sym"

    def params_bytes(self) -> bytes:
        return b""

    def body_size(self, numel: int) -> int:
        return 4 + numel

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        scale = float(x.abs().max()) / 127.0 if x.numel() else 0.0
        levels = torch.round(x / scale) if scale > 0 else torch.zeros_like(x)
        return struct.pack("<f", scale) + levels.to(torch.int8).numpy().tobytes()

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        (scale,) = struct.unpack_from("<f", body)
        if not np.isfinite(scale) or scale < 0:
            raise PayloadError(f"int8sym scale {scale} is not a finite number >= 0")
        levels = np.frombuffer(body, dtype=np.int8, count=numel, offset=4)
        return torch.from_numpy(levels.astype(np.float32) * scale)


register_codec("int8sym", Int8SymmetricCodec, codec_id=CODEC_ID)
