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

from fedge.compression import bitpack, kernels
from fedge.compression.codec import Codec
from fedge.compression.errors import PayloadError, SpecError
from fedge.compression.wire import check_crc, parse_payload

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

    def _fused_encode(self, x: np.ndarray, generator: torch.Generator | None, body: np.ndarray) -> bool:
        """Write the body (scales, then packed codes) into ``body`` with a fused kernel; False
        where this codec has none."""
        return False

    def _scratch(self, size: int) -> np.ndarray:
        """A per-thread body buffer reused across encodes: writing into warm pages instead of a
        fresh allocation saves the page faults (~1 ms per 5 MB here)."""
        return kernels.thread_buffer(self, "body", size, lambda n: np.empty(n, dtype=np.uint8))

    @property
    def checks_finite(self) -> bool:
        # The fused encoders find NaN/inf in the max pass they make anyway: no separate pass.
        return kernels.available() and type(self)._fused_encode is not BucketedCodec._fused_encode

    def _decode_two_level(self, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(hi, lo) per bucket when 1-bit codes decode to ``hi`` or ``-lo``; else None."""
        return None

    def _decode_affine(self, scales: np.ndarray) -> tuple[float, np.ndarray] | None:
        """(offset, per-bucket multiplier) when decoding is ``(code - offset) * mult``, computed in
        float32 exactly as :meth:`_dequantize` does, so both paths agree bit for bit; else None."""
        return None

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes | memoryview:
        if kernels.available():
            body = self._scratch(self.body_size(x.numel()))
            if self._fused_encode(x.numpy(), generator, body):
                scales = body[: 4 * self.scales_per_bucket * self.num_buckets(x.numel())].view(np.float32)
                if not np.isfinite(scales).all():  # e.g. a mean |x| that overflows float32
                    raise ValueError(f"{self.name}: a bucket scale overflows float32; the update is too large")
                return memoryview(body)  # copied into the payload by pack_payload, so reusable
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

    def _fused_decode_into(self, payload: bytes | bytearray | memoryview, out: torch.Tensor, alpha: float) -> bool:
        """Validate ``payload`` and accumulate it into ``out`` with the fused kernel.

        Returns False (having touched nothing) where the kernel does not apply; raises
        PayloadError for a bad payload before writing anything into ``out``.
        """
        if not kernels.available() or out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu":
            return False
        header, body = parse_payload(payload, verify_checksum=False)
        self._check_header(header, out.numel())
        numel = header.numel
        scales = self._checked_scales(body, numel)
        affine = self._decode_affine(scales)
        two_level = self._decode_two_level(scales) if affine is None else None
        if affine is None and (two_level is None or self.bucket % 8):
            return False
        check_crc(memoryview(payload).cast("B"))
        if two_level is not None:  # 1-bit codes need no range check; +-scales are finite
            packed = np.frombuffer(body[scales.nbytes :], dtype=np.uint8)
            return kernels.two_level_decode_into(packed, self.bucket, *two_level, alpha, out.numpy())
        offset, mult = affine
        packed = np.frombuffer(body[scales.nbytes :], dtype=np.uint8)
        codes = None if 8 % self.bits == 0 else kernels.unpack(packed, numel, self.bits)
        if numel:
            top = kernels.max_code_of(packed, numel, self.bits) if codes is None else int(codes.max())
            if top > self.max_code:
                raise PayloadError(f"quantized code {top} out of range 0..{self.max_code}")
        # Largest |decoded value|: above float32's range the reference decoder yields inf and fails.
        with np.errstate(over="ignore"):
            extreme = np.float32(max(offset, self.max_code - offset)) * np.abs(mult).max(initial=np.float32(0))
        if not np.isfinite(extreme):
            raise PayloadError("decoded values are not all finite")
        if codes is None:
            kernels.bucketed_decode_into(packed, numel, self.bits, self.bucket, offset, mult, alpha, out.numpy())
        else:
            kernels.accumulate_codes(codes, self.bucket, offset, mult, alpha, out.numpy())
        return True

    def decode_into(self, payload: bytes | bytearray | memoryview, out: torch.Tensor, alpha: float = 1.0) -> None:
        if not self._fused_decode_into(payload, out, alpha):
            super().decode_into(payload, out, alpha)

    def decode(self, payload: bytes | bytearray | memoryview, expected_numel: int) -> torch.Tensor:
        out = self._zeros_for(payload, expected_numel)
        if self._fused_decode_into(payload, out, 1.0):
            return out
        return super().decode(payload, expected_numel)

    def _checked_scales(self, body: memoryview, numel: int) -> np.ndarray:
        scale_bytes = 4 * self.scales_per_bucket * self.num_buckets(numel)
        scales = np.frombuffer(body[:scale_bytes], dtype="<f4")
        if not np.isfinite(scales).all():
            raise PayloadError("a bucket scale is NaN or infinite")
        if (scales < 0).any():
            raise PayloadError("a bucket scale is negative")
        return scales

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        nb = self.num_buckets(numel)
        scale_bytes = 4 * self.scales_per_bucket * nb
        scales = self._checked_scales(body, numel)
        codes = bitpack.unpack(body[scale_bytes:], numel, self.bits)
        if numel and int(codes.max()) > self.max_code:
            raise PayloadError(f"quantized code {int(codes.max())} out of range 0..{self.max_code}")
        padded = torch.zeros(nb * self.bucket, dtype=torch.uint8)
        padded[:numel] = torch.from_numpy(codes)
        scale_t = torch.from_numpy(scales.astype(np.float32)).view(nb, self.scales_per_bucket)
        return self._dequantize(scale_t, padded.view(nb, self.bucket)).reshape(-1)[:numel]
