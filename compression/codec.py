"""The codec abstraction: a small pure object that turns a flat float32 tensor into wire bytes.

A codec is configured once from its spec string and is stateless afterwards (error feedback is a
separate wrapper, :class:`compression.error_feedback.ErrorFeedback`), so one instance can serve every
client of a round and the coordinator's decoder alike.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch

from fedge.compression.errors import PayloadError
from fedge.compression.wire import CODEC_IDS, HEADER_SIZE, Header, check_crc, pack_payload, parse_payload

__all__ = ["Codec", "all_finite", "as_flat_float32"]


def all_finite(x: torch.Tensor) -> bool:
    """True when no element is NaN or infinite.

    One summing pass decides the common case (a finite sum means finite elements); only when the
    sum is not finite, which large but finite values can also cause, is the exact check run.
    """
    return math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


def as_flat_float32(x: torch.Tensor, *, check_finite: bool = True) -> torch.Tensor:
    """Return ``x`` as a contiguous 1-D float32 CPU tensor, refusing non-finite values.

    Encoding NaN or inf would poison every model that averages the update, so the client fails
    loudly instead (its reply becomes an error the coordinator logs).
    """
    flat = x.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
    if check_finite and not all_finite(flat):
        raise ValueError("cannot encode a tensor with NaN or infinite values")
    return flat


class Codec(ABC):
    """Encode/decode a flat float32 vector to/from the self-describing wire format."""

    #: Name used in spec strings and in :data:`compression.wire.CODEC_IDS`.
    name: ClassVar[str]
    #: True when E[decode(encode(x))] == x, so error feedback is optional rather than required.
    unbiased: ClassVar[bool]
    #: True when both sides must bind the codec to a support they share (:meth:`with_support`)
    shares_support: ClassVar[bool] = False

    @property
    def codec_id(self) -> int:
        return CODEC_IDS[self.name]

    @property
    @abstractmethod
    def spec(self) -> str:
        """Canonical spec string (every parameter spelled out), e.g. ``qsgd:bits=4,bucket=512``."""

    @abstractmethod
    def params_bytes(self) -> bytes:
        """The 8-byte codec-parameter field of the header."""

    @abstractmethod
    def body_size(self, numel: int) -> int:
        """Exact body length in bytes for ``numel`` elements."""

    @abstractmethod
    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes | memoryview:
        """Encode a validated flat float32 tensor into the body bytes (a view avoids one copy)."""

    @abstractmethod
    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        """Decode a body whose length has already been checked against :meth:`body_size`."""

    def for_model(self, sizes: list[int] | tuple[int, ...]) -> Codec:
        """The codec bound to a model's tensor sizes (in flattening order). Only per-tensor policies
        (``layerwise``) use them; every other codec treats the update as one flat vector."""
        return self

    def for_round(self, server_round: int, seed: int) -> Codec:
        """The codec that encodes round ``server_round``'s updates. Most codecs are the same every
        round; schedules (DGC's sparsity warm-up) and round-shared randomness (random-k's common
        support) derive their round's codec here, identically on every client and the server."""
        return self

    def with_support(self, support: np.ndarray | None) -> Codec:
        """The codec bound to a support of coordinates that the encoder and the decoder both know
        (the last downlink change's: ``compression.shared_support``). Only codecs that
        :attr:`shares_support` use it; every other codec is the same with any support."""
        return self

    def make_memory(self, wire: Codec, numel: int, state: dict[str, torch.Tensor] | None):  # type: ignore[no-untyped-def]
        """The client-side memory that wraps ``wire`` (this round's codec): error feedback by
        default, restored from ``state`` (a previous :meth:`state_dict` of the same memory)."""
        from fedge.compression.error_feedback import ErrorFeedback

        residual = (state or {}).get("residual")
        return ErrorFeedback(wire, numel, residual)

    @property
    def checks_finite(self) -> bool:
        """True when :meth:`_encode_body` rejects NaN/inf itself (saving the separate pass)."""
        return False

    def wire_bytes(self, numel: int) -> int:
        """Bytes on the wire (header included) for ``numel`` elements: exact for fixed-size codecs,
        an upper bound for sparsifiers whose index coding depends on the data."""
        return HEADER_SIZE + self.body_size(numel)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> bytes:
        """Encode ``x`` (any shape, flattened) into a complete payload."""
        flat = as_flat_float32(x, check_finite=not self.checks_finite)
        body = self._encode_body(flat, generator)
        return pack_payload(self.codec_id, flat.numel(), self.params_bytes(), body)

    def decode(self, payload: bytes | bytearray | memoryview, expected_numel: int) -> torch.Tensor:
        """Validate ``payload`` completely and return the decoded flat float32 tensor.

        Raises :class:`PayloadError` for anything malformed, including a payload produced by a
        different codec or configuration than this one.
        """
        header, body = parse_payload(payload, verify_checksum=False)
        self._check_header(header, expected_numel)
        check_crc(memoryview(payload).cast("B"))
        out = self._decode_body(body, header.numel)
        if not all_finite(out):
            raise PayloadError("decoded values are not all finite")
        return out

    def _zeros_for(self, payload: bytes | bytearray | memoryview, expected_numel: int) -> torch.Tensor:
        """A zero accumulator for a decode, allocated only after the header is known to be valid
        (a forged element count must cost an error, not a huge allocation)."""
        header, _ = parse_payload(payload, verify_checksum=False)
        self._check_header(header, expected_numel)
        return torch.zeros(expected_numel, dtype=torch.float32)

    def decode_into(
        self, payload: bytes | bytearray | memoryview, out: torch.Tensor, alpha: float = 1.0
    ) -> None:
        """Add ``alpha * decode(payload)`` to ``out`` in place; ``out`` is untouched on error."""
        out.add_(self.decode(payload, out.numel()), alpha=alpha)

    def _check_header(self, header: Header, expected_numel: int) -> None:
        if header.codec_id != self.codec_id:
            names = {v: k for k, v in CODEC_IDS.items()}
            raise PayloadError(
                f"payload was encoded with codec {names.get(header.codec_id, header.codec_id)!r}, "
                f"expected {self.name!r}"
            )
        if header.numel != expected_numel:
            raise PayloadError(f"element count {header.numel} != expected {expected_numel}")
        if header.params != self.params_bytes().ljust(8, b"\0"):
            raise PayloadError(
                f"codec parameters {header.params.hex()} do not match {self.spec!r} "
                f"({self.params_bytes().hex()})"
            )
        self._check_body_length(header)

    def _check_body_length(self, header: Header) -> None:
        """Fixed-size codecs: the body must be exactly :meth:`body_size` bytes."""
        expected_body = self.body_size(header.numel)
        if header.body_length != expected_body:
            raise PayloadError(
                f"body is {header.body_length} bytes, {self.spec!r} needs {expected_body} "
                f"for {header.numel} elements"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)
