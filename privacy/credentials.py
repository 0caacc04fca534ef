"""Secure-aggregation identities issued by the operator, bound to the node's authentication key.

Trust on first use lets a coordinator that lies from the first round substitute its own identity
keys for a device's, and so sit in the middle of every pairwise secret. With an issuer, nothing is
trusted on first use:

1. the operator's CA (``fedge certs init``, EC P-384, its key kept offline) **endorses** each
   node's authentication key when it is made (``fedge certs node`` writes ``<name>.endorsement``:
   the node's name and public key, signed by the CA);
2. the device **binds** its Ed25519 secure-aggregation identity to that key: its authentication
   key (the one its SuperNode signs every request with) signs the identity's public key;
3. every verifier (the coordinator, and each device for its peers) checks both signatures against
   the CA certificate it holds. The credential names the node, so logs say who was refused.

A coordinator holding no CA key cannot make a credential, so it cannot enrol identities of its
own; an operator who issues extra nodes can (see SECURITY.md, "Not protected").
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedge.privacy.errors import AdvertisementError

__all__ = ["CredentialError", "Credential", "endorse", "bind_identity", "verify_credential", "load_issuer",
           "load_node_key"]

_ENDORSE_LABEL = b"fedge-node-endorsement-v1|"
_BIND_LABEL = b"fedge-secagg-identity-v1|"
_MAGIC_ENDORSEMENT = b"FNE1"
_MAGIC_CREDENTIAL = b"FSC1"
_HEADER = struct.Struct("<4sHHH")  # magic and three field lengths
_MAX_FIELD = 4096
_SIGN = ec.ECDSA(hashes.SHA384())
_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


class CredentialError(AdvertisementError):
    """An identity credential is malformed, or not issued by the operator's CA, or bound to another key."""


def _pack(magic: bytes, *fields: bytes) -> bytes:
    return _HEADER.pack(magic, *(len(f) for f in fields)) + b"".join(fields)


def _unpack(magic: bytes, data: bytes, what: str) -> tuple[bytes, bytes, bytes]:
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise CredentialError(f"{what}: {len(data)} bytes, too short for its header")
    said, *lengths = _HEADER.unpack_from(data)
    if said != magic:
        raise CredentialError(f"{what}: wrong magic {said!r}")
    if any(n > _MAX_FIELD for n in lengths) or _HEADER.size + sum(lengths) != len(data):
        raise CredentialError(f"{what}: field lengths {lengths} do not add up to its {len(data)} bytes")
    at, out = _HEADER.size, []
    for n in lengths:
        out.append(data[at:at + n])
        at += n
    return out[0], out[1], out[2]


def endorse(ca_key: ec.EllipticCurvePrivateKey, name: str, node_public: ec.EllipticCurvePublicKey) -> bytes:
    """The CA's endorsement of one node's authentication key (what ``fedge certs node`` writes)."""
    spki = node_public.public_bytes(*_SPKI)
    raw_name = name.encode()
    signature = ca_key.sign(_ENDORSE_LABEL + struct.pack("<H", len(raw_name)) + raw_name + spki, _SIGN)
    return _pack(_MAGIC_ENDORSEMENT, raw_name, spki, signature)


def bind_identity(node_key: ec.EllipticCurvePrivateKey, endorsement: bytes, identity_public: bytes) -> bytes:
    """The device's credential: its endorsement plus its authentication key's signature over its
    secure-aggregation identity. Refuses an endorsement of another key (a mix-up on the device)."""
    _, spki, _ = _unpack(_MAGIC_ENDORSEMENT, endorsement, "the endorsement")
    if spki != node_key.public_key().public_bytes(*_SPKI):
        raise CredentialError("the endorsement is for another authentication key than this node's")
    binding = node_key.sign(_BIND_LABEL + bytes(identity_public), _SIGN)
    return _pack(_MAGIC_CREDENTIAL, bytes(endorsement), binding, b"")


@dataclass(frozen=True)
class Credential:
    """What a verified credential says: the node's name and its authentication key (DER)."""

    name: str
    node_key: bytes


def verify_credential(credential: bytes, identity_public: bytes, issuer: ec.EllipticCurvePublicKey) -> Credential:
    """Check that ``identity_public`` was bound by a node key that ``issuer`` endorsed; raises
    :class:`CredentialError` naming what failed."""
    endorsement, binding, rest = _unpack(_MAGIC_CREDENTIAL, credential, "the identity credential")
    if rest:
        raise CredentialError("the identity credential has trailing fields")
    raw_name, spki, ca_signature = _unpack(_MAGIC_ENDORSEMENT, endorsement, "the endorsement")
    try:
        name = raw_name.decode()
    except UnicodeDecodeError:
        raise CredentialError("the endorsement's node name is not text") from None
    try:
        issuer.verify(ca_signature, _ENDORSE_LABEL + struct.pack("<H", len(raw_name)) + raw_name + spki, _SIGN)
    except InvalidSignature:
        raise CredentialError(f"node {name!r}'s authentication key is not endorsed by the operator's CA") from None
    try:
        node_key = serialization.load_der_public_key(spki)
    except ValueError as error:
        raise CredentialError(f"node {name!r}: its endorsed key does not parse: {error}") from None
    if not isinstance(node_key, ec.EllipticCurvePublicKey):
        raise CredentialError(f"node {name!r}: its endorsed key is not an EC key")
    try:
        node_key.verify(binding, _BIND_LABEL + bytes(identity_public), _SIGN)
    except InvalidSignature:
        raise CredentialError(f"node {name!r}'s secure-aggregation identity is not the one its "
                              "authentication key signed") from None
    return Credential(name, spki)


def check_distinct(credentials: dict[int, Credential]) -> None:
    """Refuse two participants that carry one endorsed node key or one name: a node key can bind any
    number of identities, and a colluder with many would pass every quorum alone (privacy audit 2,
    N2). Raises :class:`CredentialError` naming both."""
    seen: dict[object, int] = {}
    for node, credential in sorted(credentials.items()):
        for mark, what in (((0, credential.node_key), "endorsed node key"), ((1, credential.name), "name")):
            if mark in seen:
                raise CredentialError(f"devices {seen[mark]} and {node} carry the same {what} "
                                      f"({credential.name!r}): one endorsement, one participant")
            seen[mark] = node


def load_issuer(path: str | Path) -> ec.EllipticCurvePublicKey:
    """The operator CA's public key from its PEM certificate; :class:`CredentialError` if unusable."""
    try:
        key = x509.load_pem_x509_certificate(Path(path).read_bytes()).public_key()
    except (OSError, ValueError) as error:
        raise CredentialError(f"the identity issuer {path}: not a readable PEM certificate ({error})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise CredentialError(f"the identity issuer {path}: not an EC certificate (`fedge certs init` makes one)")
    return key


def load_node_key(path: str | Path) -> ec.EllipticCurvePrivateKey:
    """A node's authentication key (OpenSSH, as ``fedge certs node`` writes it)."""
    try:
        key = serialization.load_ssh_private_key(Path(path).read_bytes(), None)
    except (OSError, ValueError) as error:
        raise CredentialError(f"the node key {path}: not a readable OpenSSH private key ({error})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CredentialError(f"the node key {path}: SuperNode keys are EC (`fedge certs node`)")
    return key
