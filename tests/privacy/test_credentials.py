"""Issued identities expire and can be revoked (privacy audit 2, N9): an endorsement carries its
expiry under the CA's signature, the operator's CA-signed list revokes one before then, and every
verifier (the coordinator, each device) refuses both, and a list the CA did not sign."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.deploy.certs import init_ca, make_node_key, revoke_node
from fedge.privacy.credentials import (
    REVOCATIONS_FILE,
    CredentialError,
    bind_identity,
    endorse,
    load_issuer,
    load_node_key,
    verify_credential,
)


def _credential(certs: Path, name: str, **endorsement):  # type: ignore[no-untyped-def]
    """A node of ``certs``'s CA with an identity bound to it: (credential, identity public bytes)."""
    key = make_node_key(certs, name)
    node_key = load_node_key(key.private_key)
    if endorsement:  # another expiry than make_node_key's
        ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        key.endorsement.write_bytes(endorse(ca_key, name, node_key.public_key(), **endorsement))  # type: ignore[union-attr]
    raw = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    return bind_identity(node_key, key.endorsement.read_bytes(), raw), raw  # type: ignore[union-attr]


def test_an_endorsement_is_refused_once_it_expires(tmp_path: Path) -> None:
    ca = init_ca(tmp_path)
    credential, raw = _credential(tmp_path, "device-1", valid_days=30, now=time.time())
    issuer = load_issuer(ca)
    checked = verify_credential(credential, raw, issuer)
    assert checked.name == "device-1" and checked.expires > time.time() + 29 * 86400
    verify_credential(credential, raw, issuer, now=time.time() + 29 * 86400)
    with pytest.raises(CredentialError, match="expired on"):
        verify_credential(credential, raw, issuer, now=time.time() + 31 * 86400)
    # the expiry is signed: moving it forward breaks the CA's signature
    endorsement_at = 4 + 2 * 3
    forged = bytearray(credential)
    (name_len, spki_len, expiry_len, _) = struct.unpack_from("<4H", credential, endorsement_at + 4)
    at = endorsement_at + 4 + 8 + name_len + spki_len
    forged[at:at + expiry_len] = struct.pack("<Q", 2**40)
    with pytest.raises(CredentialError, match="not endorsed by the operator's CA"):
        verify_credential(bytes(forged), raw, issuer, now=time.time() + 31 * 86400)


def test_a_revoked_node_is_refused_and_a_list_the_ca_did_not_sign_is_an_error(tmp_path: Path) -> None:
    ca = init_ca(tmp_path)
    retired, retired_raw = _credential(tmp_path, "device-1")
    kept, kept_raw = _credential(tmp_path, "device-2")
    assert verify_credential(retired, retired_raw, load_issuer(ca)).name == "device-1"
    listed = revoke_node(tmp_path, "device-1")
    assert listed == tmp_path / REVOCATIONS_FILE
    issuer = load_issuer(ca)  # reads the list beside ca.crt
    with pytest.raises(CredentialError, match="revoked by the operator"):
        verify_credential(retired, retired_raw, issuer)
    assert verify_credential(kept, kept_raw, issuer).name == "device-2"
    revoke_node(tmp_path, "device-1")  # revoking twice keeps one entry
    assert len(json.loads(listed.read_text())["list"]["revoked"]) == 1
    # a coordinator (or anyone) that edits the list to un-revoke a node is caught, not ignored
    document = json.loads(listed.read_text())
    document["list"]["revoked"] = []
    listed.write_text(json.dumps(document))
    with pytest.raises(CredentialError, match="not signed by the operator's CA"):
        load_issuer(ca)
    listed.write_text("not json")
    with pytest.raises(CredentialError, match="malformed"):
        load_issuer(ca)


def test_a_version_1_endorsement_without_expiry_is_refused_with_what_to_do(tmp_path: Path) -> None:
    ca = init_ca(tmp_path)
    credential, raw = _credential(tmp_path, "device-1")
    old = bytearray(credential)
    old[10:14] = b"FNE1"  # the endorsement inside the credential, as version 1 wrote it
    with pytest.raises(CredentialError, match="never expires; issue the node again"):
        verify_credential(bytes(old), raw, load_issuer(ca))
    with pytest.raises(ValueError, match="positive number of days"):
        endorse(ec.generate_private_key(ec.SECP384R1()), "n", ec.generate_private_key(ec.SECP384R1()).public_key(),
                valid_days=0)


def test_an_older_revocation_list_or_none_is_refused_once_a_newer_one_was_seen(tmp_path: Path) -> None:
    """Privacy audit 3, F7: the list had no serial, so a coordinator (or anyone who can write beside
    ``ca.crt``) could put back an older signed list, or remove it, and re-admit a revoked device.
    Each list the operator signs now carries a serial one higher than the last; the coordinator
    (in its checkpoint) and every device (in its state directory) keep the highest they have seen
    and refuse an older list, or none."""
    from flwr.app import Context, RecordDict

    from fedge.edge_client.secure_aggregation import _issuer
    from fedge.privacy.spec import parse_secure_aggregation
    from fedge.coordinator.secure_session import SecureSession

    certs = tmp_path / "certs"
    init_ca(certs)
    keys = {name: make_node_key(certs, name) for name in ("device-0", "device-1", "device-2")}
    ca, listed = certs / "ca.crt", certs / REVOCATIONS_FILE
    assert load_issuer(ca).serial == 0  # no list yet
    revoke_node(certs, "device-1")
    first = listed.read_bytes()
    revoke_node(certs, "device-2")
    assert load_issuer(ca).serial == 2 and len(load_issuer(ca).revoked_names) == 2
    session = SecureSession(parse_secure_aggregation(f"secagg:bits=8,clip=0.2,weight-cap=256,issuer={ca}"), 1)
    config = {"secagg-auth-key": str(keys["device-0"].private_key),
              "secagg-endorsement": str(keys["device-0"].endorsement), "secagg-issuer": str(ca),
              "state-dir": str(tmp_path / "device-0")}
    device = Context(run_id=1, node_id=1, node_config=config, state=RecordDict(), run_config={})
    assert _issuer(device).serial == 2
    listed.write_bytes(first)  # the older list put back: device-2 would be admitted again
    with pytest.raises(CredentialError, match="serial 1, older than 2"):
        load_issuer(ca, highest_seen=2)
    with pytest.raises(CredentialError, match="older than 2"):
        session.round(1, [1, 2], 10, weighted=False)
    restarted = Context(run_id=1, node_id=1, node_config=config, state=RecordDict(), run_config={})
    with pytest.raises(CredentialError, match="older than 2"):  # the state directory remembers
        _issuer(restarted)
    listed.unlink()  # no list at all
    with pytest.raises(CredentialError, match="serial 0, older than 2"):
        _issuer(restarted)
    resumed = SecureSession(parse_secure_aggregation(f"secagg:bits=8,clip=0.2,weight-cap=256,issuer={ca}"), 1)
    resumed.load_state_dict(session.state_dict())  # the checkpoint remembers too
    with pytest.raises(CredentialError, match="older than 2"):
        resumed.round(1, [1, 2], 10, weighted=False)
