"""Byte formats of the protocol's messages, each validated before use.

- a share ciphertext: ChaCha20-Poly1305 over (dealer, holder, seed share, key share), keyed by the
  pair's X25519 ``c`` agreement; the coordinator routes it but cannot read or alter it unnoticed;
- a masked upload: header (magic, node, count, ring bits) and the bit-packed ring elements;
- a reveal: the shares a surviving device discloses in the last stage, one record per neighbour.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from fedge.privacy.errors import MaskedInputError, ShareError, UnmaskError
from fedge.privacy.keys import RoundContext
from fedge.privacy.ring import pack_ring, packed_ring_size, unpack_ring
from fedge.privacy.shamir import SHARE_BYTES

__all__ = [
    "SEED", "KEY",
    "seal_shares", "open_shares",
    "encode_masked", "decode_masked",
    "Reveal", "encode_reveals", "decode_reveals",
]

SEED, KEY = 0, 1
_PLAIN = struct.Struct("<QQ")
_MASKED = struct.Struct("<4sQIB")
_MASKED_MAGIC = b"FSM1"
_REVEAL = struct.Struct("<QB")
_MAX_REVEALS = 1 << 16


def _nonce(dealer: int) -> bytes:
    # each pair key encrypts exactly two messages, one per direction: the dealer's id tells them apart
    return struct.pack("<Q", dealer) + bytes(4)


def seal_shares(key: bytes, context: RoundContext, dealer: int, holder: int, seed_share: bytes,
                key_share: bytes) -> bytes:
    plain = _PLAIN.pack(dealer, holder) + seed_share + key_share
    return ChaCha20Poly1305(key).encrypt(_nonce(dealer), plain, context.label(b"share", dealer, holder))


def open_shares(key: bytes, context: RoundContext, dealer: int, holder: int, sealed: bytes) -> tuple[bytes, bytes]:
    """(seed share, key share) of ``dealer`` for ``holder``; :class:`ShareError` if altered or misrouted."""
    try:
        plain = ChaCha20Poly1305(key).decrypt(_nonce(dealer), bytes(sealed), context.label(b"share", dealer, holder))
    except InvalidTag as error:
        raise ShareError(f"the shares from device {dealer} to device {holder} failed authentication: "
                         "altered in transit, or sealed for another round or device") from error
    if len(plain) != _PLAIN.size + 2 * SHARE_BYTES:
        raise ShareError(f"shares from device {dealer}: {len(plain)} bytes, expected {_PLAIN.size + 2 * SHARE_BYTES}")
    said_dealer, said_holder = _PLAIN.unpack_from(plain)
    if (said_dealer, said_holder) != (dealer, holder):
        raise ShareError(f"shares routed as {dealer}->{holder} say {said_dealer}->{said_holder}")
    at = _PLAIN.size
    return plain[at:at + SHARE_BYTES], plain[at + SHARE_BYTES:]


def encode_masked(node: int, values: np.ndarray, bits: int) -> bytes:
    return _MASKED.pack(_MASKED_MAGIC, node, values.size, bits) + pack_ring(values, bits)


def masked_size(count: int, bits: int) -> int:
    """The exact byte length of a masked upload of ``count`` ring elements of ``bits`` bits."""
    return _MASKED.size + packed_ring_size(count, bits)


def decode_masked(data: bytes, node: int, count: int, bits: int) -> np.ndarray:
    """The ring elements of ``node``'s masked upload; :class:`MaskedInputError` if anything disagrees."""
    data = bytes(data)
    if len(data) < _MASKED.size:
        raise MaskedInputError(f"device {node}: a masked upload of {len(data)} bytes has no header")
    magic, said_node, said_count, said_bits = _MASKED.unpack_from(data)
    if magic != _MASKED_MAGIC:
        raise MaskedInputError(f"device {node}: not a masked upload (magic {magic!r})")
    if (said_node, said_count, said_bits) != (node, count, bits):
        raise MaskedInputError(f"device {node}: upload says node {said_node}, {said_count} values of "
                               f"{said_bits} bits; the round expects node {node}, {count} of {bits}")
    body = memoryview(data)[_MASKED.size:]
    if len(body) != packed_ring_size(count, bits):
        raise MaskedInputError(f"device {node}: {len(body)} payload bytes, expected {packed_ring_size(count, bits)}")
    return unpack_ring(body, count, bits)


@dataclass(frozen=True)
class Reveal:
    """One share a surviving device discloses: ``kind`` SEED for a surviving dealer, KEY for a dropped one."""

    dealer: int
    kind: int
    share: bytes


def encode_reveals(reveals: list[Reveal]) -> bytes:
    return b"".join(_REVEAL.pack(r.dealer, r.kind) + r.share for r in reveals)


def decode_reveals(data: bytes, holder: int) -> list[Reveal]:
    data = bytes(data)
    record = _REVEAL.size + SHARE_BYTES
    if len(data) % record or len(data) // record > _MAX_REVEALS:
        raise UnmaskError(f"device {holder}: {len(data)} bytes of reveals is not a whole number of records")
    out, seen = [], set()
    for at in range(0, len(data), record):
        dealer, kind = _REVEAL.unpack_from(data, at)
        if kind not in (SEED, KEY):
            raise UnmaskError(f"device {holder}: reveal of unknown kind {kind}")
        if dealer in seen:
            raise UnmaskError(f"device {holder} revealed two shares of device {dealer}")
        seen.add(dealer)
        out.append(Reveal(dealer, kind, data[at + _REVEAL.size:at + record]))
    return out
