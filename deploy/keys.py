"""Ed25519 signing keys for bundles (``fedge keys generate``), via ``cryptography``.

Keys are PEM files: the private key as unencrypted PKCS#8 (mode 0600; keep it on the machine that
exports), the public key as SubjectPublicKeyInfo (what edge devices trust). A key id is the
SHA-256 of the raw 32-byte public key, so a verifier can tell which key a signature claims without
trusting anything the bundle says. Imports no torch: edge devices load public keys with this module.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedge.deploy.atomic import atomic_write_bytes

__all__ = [
    "PRIVATE_KEY_FILE",
    "PUBLIC_KEY_FILE",
    "KeyFileError",
    "generate_keypair",
    "key_id",
    "load_private_key",
    "load_public_key",
]

PRIVATE_KEY_FILE = "signing-key.pem"
PUBLIC_KEY_FILE = "signing-key.pub.pem"


class KeyFileError(ValueError):
    """A key file is missing, unreadable, or not an Ed25519 key."""


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def generate_keypair(out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new key pair into ``out_dir``; refuse to replace an existing private key."""
    directory = Path(out_dir)
    private_path, public_path = directory / PRIVATE_KEY_FILE, directory / PUBLIC_KEY_FILE
    if private_path.exists() and not overwrite:
        raise KeyFileError(f"{private_path} exists: refusing to overwrite a signing key")
    key = Ed25519PrivateKey.generate()
    directory.mkdir(parents=True, exist_ok=True)
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    old_umask = os.umask(0o077)  # the temporary file is created private, before the rename
    try:
        atomic_write_bytes(private_path, private_pem)
    finally:
        os.umask(old_umask)
    os.chmod(private_path, 0o600)
    atomic_write_bytes(public_path, public_pem, mode=0o644)
    return private_path, public_path


def _read(path: str | os.PathLike[str]) -> bytes:
    file = Path(path)
    if file.is_dir():
        raise KeyFileError(f"{file} is a directory, expected a PEM key file")
    try:
        return file.read_bytes()
    except OSError as err:
        raise KeyFileError(f"cannot read key {file}: {err}") from err


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(_read(path), password=None)
    except (ValueError, TypeError) as err:
        raise KeyFileError(f"{path} is not an unencrypted PEM private key: {err}") from err
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} is a {type(key).__name__}, bundles are signed with Ed25519")
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    data = _read(path)
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        try:  # a private key file also names its public key
            return load_private_key(path).public_key()
        except KeyFileError:
            raise KeyFileError(f"{path} is not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path} is a {type(key).__name__}, bundles are signed with Ed25519")
    return key
