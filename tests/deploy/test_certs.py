"""Certificates made with ``cryptography``: a CA, a server certificate with the right SANs, SuperNode keys
in the OpenSSH format Flower reads; private keys 0600 and never silently overwritten."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

from fedge.deploy.certs import CertificateError, init_ca, issue_server_certificate, make_node_key


def test_server_certificate_is_signed_by_the_ca_and_names_every_host(tmp_path: Path) -> None:
    ca_path = init_ca(tmp_path)
    issued = issue_server_certificate(tmp_path, ["coordinator.example.org", "10.0.0.5", "::1"])
    ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
    cert = x509.load_pem_x509_certificate(issued.certificate.read_bytes())
    cert.verify_directly_issued_by(ca)  # raises if the signature or issuer is wrong
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["coordinator.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("::1")]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_after_utc <= ca.not_valid_after_utc
    for key in (tmp_path / "ca.key", issued.key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_node_keys_are_p384_openssh_pairs(tmp_path: Path) -> None:
    node = make_node_key(tmp_path, "device-1")
    private = load_ssh_private_key(node.private_key.read_bytes(), None)
    public = load_ssh_public_key(node.public_key.read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert private.public_key().public_numbers() == public.public_numbers()
    assert stat.S_IMODE(node.private_key.stat().st_mode) == 0o600
    assert node.fingerprint.startswith("SHA256:")


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match="no CA"):
        issue_server_certificate(tmp_path, ["127.0.0.1"])
    init_ca(tmp_path)
    before = (tmp_path / "ca.key").read_bytes()
    with pytest.raises(CertificateError, match="refusing to overwrite"):
        init_ca(tmp_path)
    assert (tmp_path / "ca.key").read_bytes() == before
    with pytest.raises(CertificateError, match="at least one host"):
        issue_server_certificate(tmp_path, [])
    with pytest.raises(CertificateError, match="not a host name"):
        issue_server_certificate(tmp_path, ["http://x"])
    with pytest.raises(CertificateError, match="node name"):
        make_node_key(tmp_path, "../escape")
    make_node_key(tmp_path, "n")
    with pytest.raises(CertificateError, match="refusing to overwrite"):
        make_node_key(tmp_path, "n")
    make_node_key(tmp_path, "n", force=True)
