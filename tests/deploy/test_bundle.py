"""Signed bundles: the genuine one is accepted; every tampering case is rejected with its own error."""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.deploy.bundle import (
    ENVELOPE_FILE,
    MODEL_FILE,
    PAYLOAD_TYPE,
    AcceptedRounds,
    ExpiredError,
    GoldenTestError,
    InputError,
    IntegrityError,
    ManifestError,
    ModelSignatureError,
    RollbackError,
    RuntimeCompatibilityError,
    SignatureError,
    pae,
    read_statement_unverified,
    verify_bundle,
    write_bundle,
)
from fedge.deploy.exporter import ExportOptions, export_bundle
from fedge.deploy.keys import load_private_key, load_public_key


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory, trained_model_file: Path, keypair) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "genuine"
    export_bundle(trained_model_file, out, load_private_key(keypair[0]), ExportOptions())
    return out


@pytest.fixture
def bundle(genuine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the genuine bundle to tamper with."""
    copy = tmp_path / "bundle"
    shutil.copytree(genuine, copy)
    return copy


@pytest.fixture
def trusted(keypair) -> list:
    return [load_public_key(keypair[1])]


def _other_model() -> bytes:
    """A valid ONNX model with the same signature: an untrained digits CNN."""
    import torch

    from fedge.deploy.onnx_export import export_onnx
    from fedge.tasks import make_task

    torch.manual_seed(1)
    return export_onnx(make_task("digits").build_model(), torch.zeros(1, 1, 8, 8)).data


def _resign(bundle: Path, out: Path, private_key_path: Path, mutate: Callable[[dict[str, Any]], None]) -> Path:
    """A validly signed bundle whose predicate differs: what a key holder could publish."""
    predicate = read_statement_unverified(bundle)["predicate"]
    mutate(predicate)
    write_bundle(out, (bundle / MODEL_FILE).read_bytes(), predicate, load_private_key(private_key_path))
    return out


def test_genuine_bundle_is_accepted_and_runs(bundle: Path, trusted, tmp_path: Path) -> None:
    store = AcceptedRounds(tmp_path / "accepted.json")
    verified = verify_bundle(bundle, trusted, accepted=store)
    predicate = verified.predicate
    assert predicate["round"] == 5 and predicate["task"] == "digits"
    assert predicate["quantization"]["mode"] == "int8"
    assert predicate["quality"]["bundle"] >= predicate["quality"]["fp32"] - 0.01
    assert json.loads(store.path.read_text())["digits"]["round"] == 5
    x = np.zeros((3, 1, 8, 8), np.float32)
    assert verified.run(x).shape == (3, 10)
    # Verifying the bundle that was accepted last again is fine (same round, same digest).
    verify_bundle(bundle, trusted, accepted=store)


def test_altered_model_byte_is_rejected(bundle: Path, trusted) -> None:
    data = bytearray((bundle / MODEL_FILE).read_bytes())
    data[len(data) // 2] ^= 0x01
    (bundle / MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        verify_bundle(bundle, trusted)


def test_truncated_or_extended_model_is_rejected(bundle: Path, trusted) -> None:
    data = (bundle / MODEL_FILE).read_bytes()
    (bundle / MODEL_FILE).write_bytes(data + b"\0")
    with pytest.raises(IntegrityError, match="bytes"):
        verify_bundle(bundle, trusted)
    (bundle / MODEL_FILE).write_bytes(data[:-1])
    with pytest.raises(IntegrityError, match="bytes"):
        verify_bundle(bundle, trusted)


def test_edited_metadata_is_rejected(bundle: Path, trusted) -> None:
    envelope = json.loads((bundle / ENVELOPE_FILE).read_text())
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["predicate"]["quality"]["bundle"] = 0.999  # a better-looking claim
    envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (bundle / ENVELOPE_FILE).write_text(json.dumps(envelope))
    with pytest.raises(SignatureError, match="no valid signature"):
        verify_bundle(bundle, trusted)


def test_rogue_key_is_rejected(bundle: Path, trusted, rogue_keypair, tmp_path: Path) -> None:
    forged = _resign(bundle, tmp_path / "forged", rogue_keypair[0], lambda p: p.update(round=99))
    with pytest.raises(SignatureError, match="trusted key"):
        verify_bundle(forged, trusted)
    # ... even when the envelope claims the trusted key's id
    envelope = json.loads((forged / ENVELOPE_FILE).read_text())
    envelope["signatures"][0]["keyid"] = json.loads((bundle / ENVELOPE_FILE).read_text())["signatures"][0]["keyid"]
    (forged / ENVELOPE_FILE).write_text(json.dumps(envelope))
    with pytest.raises(SignatureError):
        verify_bundle(forged, trusted)


def test_replayed_older_round_is_rejected(bundle: Path, trusted, keypair, tmp_path: Path) -> None:
    store = AcceptedRounds(tmp_path / "accepted.json")
    newer = _resign(bundle, tmp_path / "newer", keypair[0], lambda p: p.update(round=7))
    verify_bundle(newer, trusted, accepted=store)
    with pytest.raises(RollbackError, match="round 5, not newer than the accepted round 7"):
        verify_bundle(bundle, trusted, accepted=store)  # genuine, correctly signed, but older
    # Another model under the accepted round number is a replay too (only the same digest passes).
    predicate = read_statement_unverified(bundle)["predicate"] | {"round": 7}
    write_bundle(tmp_path / "other", _other_model(), predicate, load_private_key(keypair[0]))
    with pytest.raises(RollbackError):
        verify_bundle(tmp_path / "other", trusted, accepted=store)


def test_damaged_rollback_store_fails_closed(bundle: Path, trusted, tmp_path: Path) -> None:
    store = AcceptedRounds(tmp_path / "accepted.json")
    store.path.write_text("{not json")
    with pytest.raises(RollbackError, match="unreadable"):
        verify_bundle(bundle, trusted, accepted=store)


def test_expired_bundle_is_rejected(bundle: Path, trusted) -> None:
    predicate = read_statement_unverified(bundle)["predicate"]
    from fedge.deploy.bundle import _parse_utc

    expires = _parse_utc(predicate["expires"], "expires")
    verify_bundle(bundle, trusted, now=expires - 60)
    with pytest.raises(ExpiredError, match="expired"):
        verify_bundle(bundle, trusted, now=expires + 1)
    created = _parse_utc(predicate["created"], "created")
    with pytest.raises(ExpiredError, match="future"):
        verify_bundle(bundle, trusted, now=created - 3600)


def test_wrong_input_shape_is_rejected(bundle: Path, trusted, keypair, tmp_path: Path) -> None:
    verified = verify_bundle(bundle, trusted)
    for bad in (np.zeros((2, 1, 16, 16), np.float32), np.zeros((2, 64), np.float32),
                np.zeros((2, 1, 8, 8), np.float64), np.full((1, 1, 8, 8), np.nan, np.float32)):
        with pytest.raises(InputError):
            verified.run(bad)
    # A manifest that declares another shape than the graph has is caught at load time.
    wrong = _resign(bundle, tmp_path / "wrong", keypair[0],
                    lambda p: p["inputs"][0].update(shape=["batch", 1, 16, 16]))
    with pytest.raises(ModelSignatureError, match="differs from the manifest"):
        verify_bundle(wrong, trusted)


def test_runtime_too_old_is_rejected(bundle: Path, trusted, keypair, tmp_path: Path) -> None:
    future = _resign(bundle, tmp_path / "future", keypair[0],
                     lambda p: p["runtime"].update(min_onnxruntime="99.0"))
    with pytest.raises(RuntimeCompatibilityError, match="needs onnxruntime >= 99.0"):
        verify_bundle(future, trusted)


def test_model_swapped_after_verification_is_never_run(bundle: Path, trusted) -> None:
    verified = verify_bundle(bundle, trusted)
    x = np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)
    before = verified.run(x)
    (bundle / MODEL_FILE).write_bytes(_other_model())  # another valid ONNX model, same signature
    np.testing.assert_array_equal(verified.run(x), before)  # the session holds the verified bytes
    with pytest.raises(IntegrityError):
        verify_bundle(bundle, trusted)  # and the next verification sees the swap


def test_golden_mismatch_is_rejected(bundle: Path, trusted, keypair, tmp_path: Path) -> None:
    def corrupt(predicate: dict[str, Any]) -> None:
        golden = predicate["golden"]["outputs"]
        values = np.frombuffer(base64.b64decode(golden["data"]), "<f4").copy()
        values[::10] += 50.0  # other labels than the model gives
        golden["data"] = base64.b64encode(values.tobytes()).decode()

    bad = _resign(bundle, tmp_path / "bad", keypair[0], corrupt)
    with pytest.raises(GoldenTestError, match="golden self-test failed"):
        verify_bundle(bad, trusted)


def test_malformed_envelopes_get_named_errors(bundle: Path, trusted) -> None:
    envelope_path = bundle / ENVELOPE_FILE
    original = envelope_path.read_text()
    for text, error in [("not json", SignatureError), ("[]", SignatureError),
                        (json.dumps({"payloadType": "x", "payload": "", "signatures": []}), SignatureError),
                        (original.replace('"sig": "', '"sig": "!!'), SignatureError)]:
        envelope_path.write_text(text)
        with pytest.raises(error):
            verify_bundle(bundle, trusted)
    envelope_path.unlink()
    with pytest.raises(SignatureError, match="not a signed bundle"):
        verify_bundle(bundle, trusted)
    assert issubclass(ManifestError, Exception)


def test_accuracy_claimed_matches_a_plain_onnxruntime_session(genuine: Path) -> None:
    """Held-out accuracy measured with onnxruntime and scikit-learn only, no Fedge code."""
    import onnxruntime as ort
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    _, x_test, _, y_test = train_test_split(x, digits.target, test_size=0.2, stratify=digits.target,
                                            random_state=42)
    session = ort.InferenceSession(str(genuine / MODEL_FILE), providers=["CPUExecutionProvider"])
    predictions = session.run(None, {session.get_inputs()[0].name: x_test})[0].argmax(1)
    accuracy = float((predictions == y_test).mean())
    claimed = read_statement_unverified(genuine)["predicate"]["quality"]["bundle"]
    assert abs(accuracy - claimed) <= 1 / len(y_test) + 1e-9, (accuracy, claimed)


def test_install_swaps_the_active_model_atomically(bundle: Path, trusted, keypair, tmp_path: Path) -> None:
    from fedge.deploy.bundle import install

    root = tmp_path / "device"
    first = install(verify_bundle(bundle, trusted), root)
    assert first == root / "digits" and (first / MODEL_FILE).read_bytes() == (bundle / MODEL_FILE).read_bytes()
    verify_bundle(first, trusted)  # the installed copy is itself a valid bundle
    newer = _resign(bundle, tmp_path / "newer", keypair[0], lambda p: p.update(round=6))
    install(verify_bundle(newer, trusted), root)
    assert read_statement_unverified(root / "digits")["predicate"]["round"] == 6
    assert sorted(p.name.split("-")[1] for p in (root / "versions").iterdir()) == ["r5", "r6"]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temporary link left


def test_damaged_store_entry_fails_closed(bundle: Path, trusted, tmp_path: Path) -> None:
    store = AcceptedRounds(tmp_path / "accepted.json")
    store.path.write_text(json.dumps({"digits": {"round": "seven"}}))
    with pytest.raises(RollbackError, match="damaged entry"):
        verify_bundle(bundle, trusted, accepted=store)


def test_hostile_files_get_named_errors_not_hangs(bundle: Path, genuine: Path, trusted, keypair,
                                                 tmp_path: Path) -> None:
    envelope = bundle / ENVELOPE_FILE
    envelope.write_text("[" * 100_000)  # nesting deep enough to exhaust the JSON parser's recursion
    with pytest.raises(SignatureError, match="not usable JSON"):
        verify_bundle(bundle, trusted)
    shutil.copy(genuine / ENVELOPE_FILE, envelope)
    (bundle / MODEL_FILE).unlink()
    os.mkfifo(bundle / MODEL_FILE)  # a FIFO must not block the verifier
    with pytest.raises(IntegrityError, match="not a regular file"):
        verify_bundle(bundle, trusted)
    # A NaN tolerance would disable the golden test: the signer refuses to write it ...
    with pytest.raises(ManifestError, match="atol"):
        _resign(genuine, tmp_path / "nan", keypair[0], lambda p: p["golden"].update(atol=float("nan")))
    # ... and the verifier refuses it even when correctly signed by hand.
    statement = read_statement_unverified(genuine)
    statement["predicate"]["golden"]["atol"] = float("nan")
    payload = json.dumps(statement).encode()
    key = load_private_key(keypair[0])
    signed = tmp_path / "signed-nan"
    shutil.copytree(genuine, signed)
    (signed / ENVELOPE_FILE).write_text(json.dumps({
        "payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode(),
        "signatures": [{"keyid": "x", "sig": base64.b64encode(key.sign(pae(PAYLOAD_TYPE, payload))).decode()}],
    }))
    with pytest.raises(ManifestError, match="atol"):
        verify_bundle(signed, trusted)


def test_the_stored_round_never_goes_down(tmp_path: Path) -> None:
    store = AcceptedRounds(tmp_path / "accepted.json")
    store.record("m", 7, "a" * 64)
    with pytest.raises(RollbackError):
        store.record("m", 5, "b" * 64)
    assert json.loads(store.path.read_text())["m"]["round"] == 7


def test_the_python_api_example_in_the_docs_runs(bundle: Path, keypair, tmp_path: Path, monkeypatch) -> None:
    """docs/edge.md's Python example, run as written against a real bundle (paths substituted)."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "edge.md").read_text(encoding="utf-8")
    (example,) = re.findall(r"```python\n(.*?)```", text, re.S)
    example = (example.replace('"bundle/"', repr(str(bundle))).replace('"keys/signing-key.pub.pem"', repr(str(keypair[1])))
               .replace('"state/accepted-rounds.json"', repr(str(tmp_path / "accepted.json")))
               .replace('"models/"', repr(str(tmp_path / "models"))))
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "docs/edge.md", "exec"), {})
    assert (tmp_path / "models" / "digits").is_symlink()
