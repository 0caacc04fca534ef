"""t-of-n Shamir sharing of 32-byte secrets, through pycryptodome's ``Shamir`` (GF(2^128)).

pycryptodome shares 16-byte secrets; a 32-byte secret (a self-mask seed or an X25519 private key)
is shared as two halves with the same holder indices, and a share is ``index`` plus 32 bytes.
Holders are numbered 1..n by the dealer's sorted neighbour list, which the coordinator also knows.
Shamir itself cannot tell a wrong share from a right one: callers check what they reconstruct
(against the signed commitment or public key), see ``secagg_server``.
"""

from __future__ import annotations

from collections.abc import Sequence

from Crypto.Protocol.SecretSharing import Shamir

from fedge.privacy.errors import ShareError

__all__ = ["SHARE_BYTES", "split_secret", "combine_secret"]

SHARE_BYTES = 32
_HALF = 16


def split_secret(secret: bytes, threshold: int, holders: int) -> list[bytes]:
    """``holders`` shares of a 32-byte ``secret``; any ``threshold`` of them rebuild it. Share i is for holder i + 1."""
    if len(secret) != 32:
        raise ShareError(f"only 32-byte secrets are shared, got {len(secret)} bytes")
    if not 1 <= threshold <= holders:
        raise ShareError(f"threshold {threshold} must be in [1, {holders}]")
    if threshold == 1:  # pycryptodome needs k >= 2; a 1-of-n "share" is the secret itself
        return [secret] * holders
    low = Shamir.split(threshold, holders, secret[:_HALF])
    high = Shamir.split(threshold, holders, secret[_HALF:])
    return [a + b for (_, a), (_, b) in zip(low, high)]


def combine_secret(shares: Sequence[tuple[int, bytes]], threshold: int) -> bytes:
    """The secret from at least ``threshold`` ``(holder index, share)`` pairs (indices from 1)."""
    if len(shares) < threshold:
        raise ShareError(f"{len(shares)} shares cannot rebuild a {threshold}-of-n secret")
    for index, share in shares:
        if len(share) != SHARE_BYTES:
            raise ShareError(f"a share is {SHARE_BYTES} bytes, got {len(share)} (holder {index})")
        if index < 1:
            raise ShareError(f"holder indices start at 1, got {index}")
    chosen = list(shares)[:threshold]
    if threshold == 1:
        return bytes(chosen[0][1])
    if len({index for index, _ in chosen}) != len(chosen):
        raise ShareError("two shares claim the same holder index")
    low = Shamir.combine([(index, share[:_HALF]) for index, share in chosen])
    high = Shamir.combine([(index, share[_HALF:]) for index, share in chosen])
    return low + high
