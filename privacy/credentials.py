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

An endorsement carries an expiry (``fedge certs node --days``, default 365), signed with the rest,
and the operator can revoke one before then (``fedge certs revoke``): the CA signs a list of
revoked node keys and names, ``revocations.fedge``, kept beside ``ca.crt``. Whoever loads the issuer
(the coordinator, every device) reads the list from there and refuses an expired or revoked
credential; a list whose signature does not verify is an error, never an empty list (privacy audit
2, N9). Version 1 endorsements, which had no expiry, are refused: issue the node again.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedge.privacy.errors import AdvertisementError

__all__ = ["REVOCATIONS_FILE", "CredentialError", "Credential", "Issuer", "endorse", "bind_identity",
           "verify_credential", "load_issuer", "load_node_key", "read_revocations", "revoke"]

_ENDORSE_LABEL = b"fedge-node-endorsement-v2|"
_BIND_LABEL = b"fedge-secagg-identity-v1|"
_REVOKE_LABEL = b"fedge-revocations-v1|"
_MAGIC_ENDORSEMENT = b"FNE2"  # name, node key, expiry, CA signature
_MAGIC_ENDORSEMENT_V1 = b"FNE1"  # no expiry: refused
_MAGIC_CREDENTIAL = b"FSC1"  # endorsement, binding, (empty)
_EXPIRY = struct.Struct("<Q")  # seconds since the epoch, UTC
_MAX_FIELD = 4096
#: the operator's signed list of revoked endorsements, beside the CA certificate
REVOCATIONS_FILE = "revocations.fedge"
_SIGN = ec.ECDSA(hashes.SHA384())
_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


class CredentialError(AdvertisementError):
    """An identity credential is malformed, or not issued by the operator's CA, or bound to another key."""


def _pack(magic: bytes, *fields: bytes) -> bytes:
    return struct.pack(f"<4s{len(fields)}H", magic, *(len(f) for f in fields)) + b"".join(fields)


def _unpack(magic: bytes, data: bytes, what: str, count: int) -> list[bytes]:
    data = bytes(data)
    header = struct.Struct(f"<4s{count}H")
    if len(data) >= 4 and data[:4] == _MAGIC_ENDORSEMENT_V1 and magic == _MAGIC_ENDORSEMENT:
        raise CredentialError(f"{what}: a version 1 endorsement, which never expires; issue the node again "
                              "(fedge certs node)")
    if len(data) < header.size:
        raise CredentialError(f"{what}: {len(data)} bytes, too short for its header")
    said, *lengths = header.unpack_from(data)
    if said != magic:
        raise CredentialError(f"{what}: wrong magic {said!r}")
    if any(n > _MAX_FIELD for n in lengths) or header.size + sum(lengths) != len(data):
        raise CredentialError(f"{what}: field lengths {lengths} do not add up to its {len(data)} bytes")
    at, out = header.size, []
    for n in lengths:
        out.append(data[at:at + n])
        at += n
    return out


def _endorsed(raw_name: bytes, spki: bytes, expiry: bytes) -> bytes:
    """What the CA signs: the name, the node key and the expiry, each bound to its place."""
    return _ENDORSE_LABEL + struct.pack("<H", len(raw_name)) + raw_name + struct.pack("<H", len(spki)) + spki + expiry


def endorse(ca_key: ec.EllipticCurvePrivateKey, name: str, node_public: ec.EllipticCurvePublicKey, *,
            valid_days: float = 365, now: float | None = None) -> bytes:
    """The CA's endorsement of one node's authentication key, valid ``valid_days`` from ``now``
    (what ``fedge certs node`` writes)."""
    if not valid_days > 0:
        raise ValueError(f"an endorsement must be valid for a positive number of days, got {valid_days}")
    spki = node_public.public_bytes(*_SPKI)
    raw_name = name.encode()
    expiry = _EXPIRY.pack(int((time.time() if now is None else now) + valid_days * 86400))
    signature = ca_key.sign(_endorsed(raw_name, spki, expiry), _SIGN)
    return _pack(_MAGIC_ENDORSEMENT, raw_name, spki, expiry, signature)


def bind_identity(node_key: ec.EllipticCurvePrivateKey, endorsement: bytes, identity_public: bytes) -> bytes:
    """The device's credential: its endorsement plus its authentication key's signature over its
    secure-aggregation identity. Refuses an endorsement of another key (a mix-up on the device)."""
    _, spki, _, _ = _unpack(_MAGIC_ENDORSEMENT, endorsement, "the endorsement", 4)
    if spki != node_key.public_key().public_bytes(*_SPKI):
        raise CredentialError("the endorsement is for another authentication key than this node's")
    binding = node_key.sign(_BIND_LABEL + bytes(identity_public), _SIGN)
    return _pack(_MAGIC_CREDENTIAL, bytes(endorsement), binding, b"")


@dataclass(frozen=True)
class Credential:
    """What a verified credential says: the node's name, its authentication key (DER) and when its
    endorsement expires (seconds since the epoch)."""

    name: str
    node_key: bytes
    expires: int = 0


@dataclass(frozen=True)
class Issuer:
    """The operator's CA as a verifier: its key and the endorsements it revoked (node keys by the
    SHA-256 of their DER encoding, and names)."""

    key: ec.EllipticCurvePublicKey
    revoked_keys: frozenset[str] = field(default_factory=frozenset)
    revoked_names: frozenset[str] = field(default_factory=frozenset)
    #: the revocation list's serial (0: no list, or one from before lists had serials); a verifier
    #: keeps the highest it has seen and refuses an older list, or none, after it
    serial: int = 0


def verify_credential(credential: bytes, identity_public: bytes, issuer: Issuer, *,
                      now: float | None = None) -> Credential:
    """Check that ``identity_public`` was bound by a node key that ``issuer`` endorsed, that the
    endorsement has not expired (at ``now``) and was not revoked; raises :class:`CredentialError`
    naming what failed."""
    endorsement, binding, rest = _unpack(_MAGIC_CREDENTIAL, credential, "the identity credential", 3)
    if rest:
        raise CredentialError("the identity credential has trailing fields")
    raw_name, spki, expiry, ca_signature = _unpack(_MAGIC_ENDORSEMENT, endorsement, "the endorsement", 4)
    try:
        name = raw_name.decode()
    except UnicodeDecodeError:
        raise CredentialError("the endorsement's node name is not text") from None
    if len(expiry) != _EXPIRY.size:
        raise CredentialError(f"node {name!r}: the endorsement's expiry is {len(expiry)} bytes, not {_EXPIRY.size}")
    try:
        issuer.key.verify(ca_signature, _endorsed(raw_name, spki, expiry), _SIGN)
    except InvalidSignature:
        raise CredentialError(f"node {name!r}'s authentication key is not endorsed by the operator's CA") from None
    (expires,) = _EXPIRY.unpack(expiry)
    if (time.time() if now is None else now) >= expires:
        raise CredentialError(f"node {name!r}'s endorsement expired on {_date(expires)}; the operator must issue "
                              "it again")
    if hashlib.sha256(spki).hexdigest() in issuer.revoked_keys or name in issuer.revoked_names:
        raise CredentialError(f"node {name!r}'s endorsement was revoked by the operator ({REVOCATIONS_FILE})")
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
    return Credential(name, spki, expires)


def _date(seconds: int) -> str:
    return dt.datetime.fromtimestamp(min(seconds, 253402300799), dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


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


def load_issuer(path: str | Path, highest_seen: int = 0) -> Issuer:
    """The operator's CA from its PEM certificate, with the revocations beside it
    (:data:`REVOCATIONS_FILE`, when the operator revoked any); :class:`CredentialError` if either is
    unusable, a list that is not the CA's included. ``highest_seen``: the highest list serial this
    verifier has seen; a list with a lower serial, or no list after one was seen, is refused (an
    older signed list would re-admit a revoked device: privacy audit 3, F7). The caller keeps
    ``Issuer.serial`` as its new highest."""
    try:
        key = x509.load_pem_x509_certificate(Path(path).read_bytes()).public_key()
    except (OSError, ValueError) as error:
        raise CredentialError(f"the identity issuer {path}: not a readable PEM certificate ({error})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise CredentialError(f"the identity issuer {path}: not an EC certificate (`fedge certs init` makes one)")
    revocations = Path(path).with_name(REVOCATIONS_FILE)
    serial, entries = read_revocations(revocations, key) if revocations.exists() else (0, [])
    if serial < highest_seen:
        raise CredentialError(f"the revocation list beside {path} has serial {serial}, older than {highest_seen} "
                              "seen before: an older list (or none) would re-admit revoked devices; refused")
    return Issuer(key, frozenset(e["node_key_sha256"] for e in entries), frozenset(e["name"] for e in entries),
                  serial)


def read_revocations(path: str | Path, ca_public: ec.EllipticCurvePublicKey) -> tuple[int, list[dict[str, str]]]:
    """(serial, revoked endorsements) of a signed list; a list from before serials is serial 0."""
    try:
        document = json.loads(Path(path).read_text())
        payload, signature = document["list"], base64.b64decode(document["signature"], validate=True)
        entries = payload["revoked"]
        if not (isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                                  and isinstance(e.get("node_key_sha256"), str) for e in entries)):
            raise ValueError("entries must each name a node and its key's sha256")
        serial = payload.get("serial", 0)
        if not isinstance(serial, int) or isinstance(serial, bool) or serial < 0:
            raise ValueError(f"serial {serial!r} is not a whole number >= 0")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CredentialError(f"the revocation list {path} is malformed: {error}") from None
    try:
        ca_public.verify(signature, _REVOKE_LABEL + _canonical(payload), _SIGN)
    except InvalidSignature:
        raise CredentialError(f"the revocation list {path} is not signed by the operator's CA") from None
    return serial, entries


def revoke(ca_key: ec.EllipticCurvePrivateKey, path: str | Path, name: str, node_public_der: bytes,
           *, now: float | None = None) -> bytes:
    """The signed list at ``path`` (empty if none) with one more endorsement revoked: the bytes to
    write there (``fedge certs revoke`` writes them atomically)."""
    serial, entries = read_revocations(path, ca_key.public_key()) if Path(path).exists() else (0, [])
    digest = hashlib.sha256(node_public_der).hexdigest()
    today = _date(int(time.time() if now is None else now))
    if not any(e["node_key_sha256"] == digest for e in entries):
        entries.append({"name": name, "node_key_sha256": digest, "revoked": today})
    # every list the operator signs has a higher serial than the last: verifiers refuse an older one
    payload = {"version": 1, "serial": serial + 1, "issued": today, "revoked": entries}
    signature = ca_key.sign(_REVOKE_LABEL + _canonical(payload), _SIGN)
    return (json.dumps({"list": payload, "signature": base64.b64encode(signature).decode()}, indent=1) + "\n").encode()


def _canonical(payload: object) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def load_node_key(path: str | Path) -> ec.EllipticCurvePrivateKey:
    """A node's authentication key (OpenSSH, as ``fedge certs node`` writes it)."""
    try:
        key = serialization.load_ssh_private_key(Path(path).read_bytes(), None)
    except (OSError, ValueError) as error:
        raise CredentialError(f"the node key {path}: not a readable OpenSSH private key ({error})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CredentialError(f"the node key {path}: SuperNode keys are EC (`fedge certs node`)")
    return key
