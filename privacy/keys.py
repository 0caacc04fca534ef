"""Key material of one secure-aggregation round: signed advertisements and pairwise secrets.

Each device makes two X25519 key pairs per round: ``c`` encrypts the shares it sends through the
coordinator to its neighbours, ``s`` agrees the pairwise mask seeds. It advertises both public keys,
with a commitment to its self-mask seed, signed with its long-lived Ed25519 identity key, so a
coordinator cannot substitute its own keys for a device's (the man-in-the-middle that unsigned
advertisements allow). Every secret is derived with HKDF-SHA256 over a label that names the run,
the round, the purpose and the pair, so no two uses share a key.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedge.privacy.errors import AdvertisementError

__all__ = [
    "AD_BYTES",
    "PROTOCOL_LABEL",
    "RoundContext",
    "KeyAdvertisement",
    "public_bytes",
    "private_bytes",
    "x25519_from_private_bytes",
    "derive_key",
    "seed_commitment",
]

PROTOCOL_LABEL = b"fedge-secagg-v1"
_RAW = serialization.Encoding.Raw
_AD_HEADER = struct.Struct("<4sQ")  # magic, node id
_AD_MAGIC = b"FSA1"
_KEY = 32
_SIGNATURE = 64
#: bytes of an encoded advertisement
AD_BYTES = _AD_HEADER.size + 3 * _KEY + _SIGNATURE


@dataclass(frozen=True)
class RoundContext:
    """What binds every key and message to one round of one run."""

    run_id: bytes
    round: int

    def label(self, purpose: bytes, *words: int) -> bytes:
        """A unique HKDF info / associated-data string for ``purpose`` and the given integers."""
        packed = b"".join(struct.pack("<Q", w) for w in words)
        return b"|".join([PROTOCOL_LABEL, self.run_id, struct.pack("<Q", self.round), purpose, packed])


def public_bytes(key: X25519PublicKey | Ed25519PublicKey) -> bytes:
    return key.public_bytes(_RAW, serialization.PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def x25519_from_private_bytes(data: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(data)


def derive_key(private: X25519PrivateKey, peer_public: bytes, info: bytes) -> bytes:
    """A 32-byte key from X25519 agreement, through HKDF-SHA256 (the raw shared point is never used)."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as error:  # a low-order point gives an all-zero secret
        raise AdvertisementError(f"key agreement failed: {error}") from error
    return HKDF(algorithm=hashes.SHA256(), length=_KEY, salt=None, info=info).derive(shared)


def seed_commitment(context: RoundContext, node: int, seed: bytes) -> bytes:
    """SHA-256 commitment to a device's self-mask seed, so a reconstructed seed can be checked."""
    return hashlib.sha256(context.label(b"seed-commitment", node) + seed).digest()


@dataclass(frozen=True)
class KeyAdvertisement:
    """A device's public keys for one round, signed with its identity key."""

    node: int
    c_public: bytes
    s_public: bytes
    commitment: bytes
    signature: bytes

    @staticmethod
    def _message(context: RoundContext, plan_digest: bytes, node: int, c_public: bytes, s_public: bytes,
                 commitment: bytes) -> bytes:
        return context.label(b"advertise", node) + plan_digest + c_public + s_public + commitment

    @classmethod
    def create(cls, context: RoundContext, node: int, identity: Ed25519PrivateKey, c_public: bytes,
               s_public: bytes, commitment: bytes, *, plan_digest: bytes) -> "KeyAdvertisement":
        """Signed over the round and the plan's digest: the keys are good for this plan only."""
        signature = identity.sign(cls._message(context, plan_digest, node, c_public, s_public, commitment))
        return cls(node, c_public, s_public, commitment, signature)

    def verify(self, context: RoundContext, identity_public: Ed25519PublicKey | None, *, plan_digest: bytes) -> None:
        """Raise :class:`AdvertisementError` unless this advertisement is signed by ``identity_public``
        for this round's plan."""
        if identity_public is None:
            raise AdvertisementError(f"device {self.node} has no registered identity key: its advertisement "
                                     "cannot be checked and is refused")
        if not self.signature:
            raise AdvertisementError(f"device {self.node}'s key advertisement is unsigned")
        try:
            identity_public.verify(self.signature, self._message(context, plan_digest, self.node, self.c_public,
                                                                 self.s_public, self.commitment))
        except InvalidSignature as error:
            raise AdvertisementError(f"device {self.node}'s key advertisement has an invalid signature "
                                     "(another round or plan, another identity, or altered keys)") from error

    def to_bytes(self) -> bytes:
        return (_AD_HEADER.pack(_AD_MAGIC, self.node) + self.c_public + self.s_public + self.commitment
                + self.signature)

    @classmethod
    def from_bytes(cls, data: bytes) -> "KeyAdvertisement":
        """Parse and length-check; raises :class:`AdvertisementError` (signature not checked here)."""
        data = bytes(data)
        expected = AD_BYTES
        if len(data) != expected:
            raise AdvertisementError(f"a key advertisement is {expected} bytes, got {len(data)}")
        magic, node = _AD_HEADER.unpack_from(data)
        if magic != _AD_MAGIC:
            raise AdvertisementError(f"not a key advertisement (magic {magic!r})")
        at = _AD_HEADER.size
        c_public, s_public, commitment = data[at:at + _KEY], data[at + _KEY:at + 2 * _KEY], data[at + 2 * _KEY:at + 3 * _KEY]
        return cls(node, c_public, s_public, commitment, data[at + 3 * _KEY:])
