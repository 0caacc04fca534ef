"""Certificates and SuperNode keys for a Fedge federation, made with ``cryptography`` (no OpenSSL CLI).

A federation needs three kinds of files, all in one directory (``fedge certs ... --dir DIR``):

=====================  ==========================================  ============================
file                   what it is                                  who gets it
=====================  ==========================================  ============================
``ca.crt``/``ca.key``  a private certificate authority (EC P-384)  ``ca.crt``: every device;
                                                                   ``ca.key``: nobody (offline)
``server.crt/.key``    the SuperLink's TLS certificate, signed by  the coordinator only
                       the CA, with the addresses devices dial as
                       subject alternative names
``<node>``/``.pub``    a SuperNode's authentication key pair:      private key: that device;
                       EC P-384 in OpenSSH format, which is what   ``.pub``: registered on the
                       ``flower-supernode --auth-supernode-        SuperLink with ``flwr
                       private-key`` and ``flwr supernode          supernode register``
                       register`` read
``<node>.endorsement`` the CA's signature over the node's name     that device (next to its key)
                       and public key (made when ``ca.key`` is
                       in the directory): the device's secure-
                       aggregation identity is bound to it, so
                       peers need not trust it on first use
=====================  ==========================================  ============================

TLS in Flower 1.41 authenticates the server (devices check ``server.crt`` against ``ca.crt``);
devices are authenticated by their registered keys (each request is signed), not by client
certificates. Private keys are written 0600 and never overwritten unless asked: replacing a CA key
by accident would lock every device out.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedge.deploy.atomic import atomic_write_bytes

__all__ = [
    "CertificateError",
    "NodeKey",
    "ServerCertificate",
    "init_ca",
    "issue_server_certificate",
    "make_node_key",
    "endorsement_path",
    "identity_node_config",
    "IDENTITY_NODE_CONFIG",
]

CA_CERT, CA_KEY = "ca.crt", "ca.key"
#: the node-config keys of an issued secure-aggregation identity: node key, endorsement, CA certificate
IDENTITY_NODE_CONFIG = ("secagg-auth-key", "secagg-endorsement", "secagg-issuer")
SERVER_CERT, SERVER_KEY = "server.crt", "server.key"
_CURVE = ec.SECP384R1()


class CertificateError(RuntimeError):
    """A certificate file is missing, would be overwritten, or cannot be used as asked."""


@dataclass(frozen=True)
class ServerCertificate:
    certificate: Path
    key: Path
    hosts: tuple[str, ...]
    not_after: dt.datetime


@dataclass(frozen=True)
class NodeKey:
    private_key: Path
    public_key: Path
    fingerprint: str  # SHA-256 of the OpenSSH public key line, as ``ssh-keygen -lf`` prints it
    endorsement: Path | None = None  # the CA's endorsement, when the CA key was at hand


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _refuse_overwrite(paths: list[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise CertificateError(f"refusing to overwrite {', '.join(existing)} (pass --force to replace)")


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey, fmt: serialization.PrivateFormat) -> None:
    atomic_write_bytes(path, key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()),
                       mode=0o600)


def init_ca(directory: str | os.PathLike[str], *, name: str = "Fedge federation CA", days: int = 3650,
            force: bool = False) -> Path:
    """Create ``ca.key`` + ``ca.crt`` in ``directory``; returns the certificate's path."""
    out = Path(directory)
    cert_path, key_path = out / CA_CERT, out / CA_KEY
    _refuse_overwrite([cert_path, key_path], force)
    key = ec.generate_private_key(_CURVE)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    _write_key(key_path, key, serialization.PrivateFormat.PKCS8)
    atomic_write_bytes(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return cert_path


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not (cert_path.exists() and key_path.exists()):
        raise CertificateError(f"no CA in {directory} (run `fedge certs init --dir {directory}` first)")
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(f"{key_path} is not an EC private key")
    return cert, key


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        if not host or any(c in host for c in " /:"):
            raise CertificateError(f"not a host name or IP address: {host!r}") from None
        return x509.DNSName(host)


def issue_server_certificate(directory: str | os.PathLike[str], hosts: list[str], *, days: int = 397,
                             force: bool = False) -> ServerCertificate:
    """Sign ``server.key`` + ``server.crt`` for the SuperLink with the CA in ``directory``.

    ``hosts`` are every name and IP address devices dial (``coordinator.example.org``, ``10.0.0.5``);
    TLS refuses a connection to any other. 397 days is the longest lifetime browsers still accept;
    rotate by issuing a new one and restarting the coordinator.
    """
    if not hosts:
        raise CertificateError("a server certificate needs at least one host name or IP address")
    out = Path(directory)
    ca_cert, ca_key = _load_ca(out)
    cert_path, key_path = out / SERVER_CERT, out / SERVER_KEY
    _refuse_overwrite([cert_path, key_path], force)
    key = ec.generate_private_key(_CURVE)
    now = _now()
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write_key(key_path, key, serialization.PrivateFormat.PKCS8)
    atomic_write_bytes(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return ServerCertificate(cert_path, key_path, tuple(hosts), not_after)


def make_node_key(directory: str | os.PathLike[str], name: str, *, force: bool = False,
                  days: float = 365) -> NodeKey:
    """``<name>`` (OpenSSH private key, 0600) and ``<name>.pub`` for one SuperNode, and, when the
    CA's key is in ``directory``, ``<name>.endorsement`` (the CA's signature over both and an
    expiry ``days`` from now)."""
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise CertificateError(f"node name must be letters, digits, '-', '_' or '.', got {name!r}")
    out = Path(directory)
    private, public = out / name, out / f"{name}.pub"
    _refuse_overwrite([private, public, endorsement_path(private)], force)
    key = ec.generate_private_key(_CURVE)
    line = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write_key(private, key, serialization.PrivateFormat.OpenSSH)
    atomic_write_bytes(public, line + f" fedge-{name}\n".encode(), mode=0o644)
    endorsement = None
    if (out / CA_KEY).exists() and (out / CA_CERT).exists():
        from fedge.privacy.credentials import endorse

        _, ca_key = _load_ca(out)
        endorsement = endorsement_path(private)
        atomic_write_bytes(endorsement, endorse(ca_key, name, key.public_key(), valid_days=days), mode=0o644)
    return NodeKey(private, public, fingerprint(line), endorsement)


def revoke_node(directory: str | os.PathLike[str], name: str) -> Path:
    """Revoke node ``name``'s endorsement before it expires: its public key (``<name>.pub`` in
    ``directory``) joins the CA-signed list beside ``ca.crt`` (``revocations.fedge``), written
    atomically. Give the list to the coordinator and every device with ``ca.crt``: each refuses a
    credential it lists from then on."""
    from fedge.privacy.credentials import REVOCATIONS_FILE, revoke

    out = Path(directory)
    _, ca_key = _load_ca(out)
    public = out / f"{name}.pub"
    try:
        node_public = serialization.load_ssh_public_key(public.read_bytes().split(b" fedge-")[0].strip())
    except (OSError, ValueError) as error:
        raise CertificateError(f"cannot read node {name!r}'s public key {public}: {error}") from None
    der = node_public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    path = out / REVOCATIONS_FILE
    atomic_write_bytes(path, revoke(ca_key, path, name, der), mode=0o644)
    return path


def endorsement_path(node_key: Path) -> Path:
    """Where a node key's endorsement lives: next to it, ``<key>.endorsement``."""
    return node_key.with_name(node_key.name + ".endorsement")


def identity_node_config(node_key: Path, ca_cert: Path) -> dict[str, str]:
    """The node config that hands a device its issued secure-aggregation identity (its key, the
    key's endorsement, the CA that checks every peer's), or nothing when the key has no endorsement."""
    endorsement = endorsement_path(node_key)
    if not endorsement.exists():
        return {}
    paths = (node_key, endorsement, ca_cert)
    return {name: str(Path(path).resolve()) for name, path in zip(IDENTITY_NODE_CONFIG, paths)}


def fingerprint(openssh_line: bytes) -> str:
    import base64
    import hashlib

    blob = base64.b64decode(openssh_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
