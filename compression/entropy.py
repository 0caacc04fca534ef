"""A lossless entropy stage: ``zstd:level=L+<codec>`` compresses another codec's payload with Zstandard.

Quantized codes are far from uniform (QSGD's levels concentrate near zero, sparse index gaps are
small), so a general-purpose entropy coder takes bytes off what the quantizer left. Zstandard via
the ``zstandard`` package (python-zstandard, the reference bindings) is fast enough to sit on the
hot path at low levels. The stage is lossless: it changes bytes on the wire, never values, so the
wrapped codec's statistics (unbiasedness, error feedback) carry over.

Body: one Zstandard frame whose content is the complete inner payload (its own header and
checksum). Decoding refuses frames that would expand beyond the inner codec's bound for the
expected element count, so a decompression bomb costs an error, not memory.
"""

from __future__ import annotations

import struct

import torch

from fedge.compression.codec import Codec
from fedge.compression.errors import PayloadError, SpecError
from fedge.compression.wire import CODEC_IDS, Header, check_crc, parse_payload

__all__ = ["ZstdCodec"]

_PARAMS = struct.Struct("<bB")  # level, inner codec id


def _compress_bound(size: int) -> int:
    """ZSTD_COMPRESSBOUND: the largest frame zstd produces for ``size`` input bytes."""
    return size + (size >> 8) + (((128 << 10) - size) >> 11 if size < (128 << 10) else 0) + 64


class ZstdCodec(Codec):
    name = "zstd"

    def __init__(self, level: int = 3, values: Codec | None = None) -> None:
        if values is None:
            raise SpecError("zstd wraps another codec: give it after '+', e.g. zstd:level=3+qsgd:bits=4")
        if not 1 <= level <= 19:
            raise SpecError(f"zstd level must be in 1..19, got {level}")
        if values.name in ("zstd", "dgc", "layerwise"):
            raise SpecError(f"zstd cannot wrap {values.name!r}: wrap the codec inside it instead")
        try:
            import zstandard
        except ImportError as err:  # pragma: no cover - part of fedge[platform]
            raise SpecError("the zstd stage needs the 'zstandard' package") from err
        self._zstd = zstandard
        self.level = level
        self.values = values
        self.unbiased = values.unbiased  # type: ignore[misc]

    @property
    def spec(self) -> str:
        return f"zstd:level={self.level}+{self.values.spec}"

    def params_bytes(self) -> bytes:
        return _PARAMS.pack(self.level, CODEC_IDS[self.values.name])

    @property
    def checks_finite(self) -> bool:
        return True  # the inner codec's encode checks

    def body_size(self, numel: int) -> int:
        """Upper bound: zstd's worst case over the inner payload's upper bound."""
        return _compress_bound(self.values.wire_bytes(numel))

    def _check_body_length(self, header: Header) -> None:
        if header.body_length > self.body_size(header.numel):
            raise PayloadError(f"body of {header.body_length} bytes exceeds the {self.spec!r} bound")

    def for_round(self, server_round: int, seed: int) -> Codec:
        inner = self.values.for_round(server_round, seed)
        return self if inner is self.values else ZstdCodec(self.level, inner)

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        inner = self.values.encode(x, generator)
        return self._zstd.ZstdCompressor(level=self.level, write_checksum=False).compress(inner)

    def _inner(self, payload: bytes | bytearray | memoryview, expected_numel: int) -> bytes:
        header, body = parse_payload(payload, verify_checksum=False)
        self._check_header(header, expected_numel)
        check_crc(memoryview(payload).cast("B"))
        limit = self.values.wire_bytes(header.numel)
        try:
            params = self._zstd.get_frame_parameters(bytes(body[:18]))
        except self._zstd.ZstdError as err:
            raise PayloadError(f"zstd frame header is invalid: {err}") from None
        if params.content_size > limit:  # 2^64-1 when unknown: refused as well
            raise PayloadError(f"zstd frame declares {params.content_size} bytes, the inner bound is {limit}")
        try:
            return self._zstd.ZstdDecompressor().decompress(body, max_output_size=limit)
        except self._zstd.ZstdError as err:
            raise PayloadError(f"zstd frame is corrupt: {err}") from None

    def decode(self, payload: bytes | bytearray | memoryview, expected_numel: int) -> torch.Tensor:
        return self.values.decode(self._inner(payload, expected_numel), expected_numel)

    def decode_into(self, payload: bytes | bytearray | memoryview, out: torch.Tensor, alpha: float = 1.0) -> None:
        self.values.decode_into(self._inner(payload, out.numel()), out, alpha)

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:  # decode() bypasses this
        raise NotImplementedError
