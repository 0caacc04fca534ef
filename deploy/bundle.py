"""Signed model bundles: write one (cloud side) and verify + load one (edge side). Imports no torch.

A bundle is a directory with ``model.onnx`` (weights inside) and ``bundle.dsse.json``: a DSSE
envelope (https://github.com/secure-systems-lab/dsse) whose payload is an in-toto Statement v1
(https://github.com/in-toto/attestation) naming the model file and its SHA-256, with Fedge's
metadata as the predicate. The signature is Ed25519 over DSSE's pre-authentication encoding, so the
signed bytes are exactly the payload bytes and their type, never a re-serialisation.

Verification (:func:`verify_bundle`) runs in this order and stops at the first failure, each with
its own exception type:

1. the envelope parses and carries a valid signature by a trusted key (:class:`SignatureError`);
2. the statement and predicate are well formed (:class:`ManifestError`);
3. the model file is read **once**; its size and SHA-256 match (:class:`IntegrityError`);
4. the bundle has not expired and was not created in the future (:class:`ExpiredError`);
5. its training round is newer than the last one accepted for this model (:class:`RollbackError`);
6. this onnxruntime is new enough and can load the model (:class:`RuntimeCompatibilityError`);
7. the *same bytes* are loaded into onnxruntime: a file swapped after step 3 is never run;
   the model's input/output signature matches the manifest (:class:`ModelSignatureError`);
8. the golden inputs reproduce the golden outputs (:class:`GoldenTestError`).

Only then is the round recorded, atomically, in the anti-rollback store.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedge.deploy.atomic import atomic_write_bytes, atomic_write_text
from fedge.deploy.keys import key_id

__all__ = [
    "ENVELOPE_FILE",
    "MODEL_FILE",
    "PAYLOAD_TYPE",
    "PREDICATE_TYPE",
    "AcceptedRounds",
    "BundleError",
    "ExpiredError",
    "GoldenTestError",
    "InputError",
    "IntegrityError",
    "LatencyReport",
    "ManifestError",
    "ModelSignatureError",
    "RollbackError",
    "RuntimeCompatibilityError",
    "SignatureError",
    "VerifiedBundle",
    "encode_golden",
    "install",
    "make_session",
    "measure_latency",
    "pae",
    "read_statement_unverified",
    "verify_bundle",
    "write_bundle",
]

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
ENVELOPE_FILE = "bundle.dsse.json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://github.com/fedge/fedge/bundle/v1"
MAX_ENVELOPE_BYTES = 16 * 2**20  # golden data included; anything larger is not ours
MAX_MODEL_BYTES = 2 * 2**30
MAX_SIGNATURES = 8
_DTYPES = ("float32", "float16", "int64", "int8", "uint8")
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:=,-]{0,127}")


class BundleError(Exception):
    """A bundle was rejected. Subclasses say which check failed."""


class SignatureError(BundleError):
    """No valid signature by a trusted key (tampered payload, rogue key, malformed envelope)."""


class ManifestError(BundleError):
    """The signed statement is not a well-formed Fedge bundle manifest."""


class IntegrityError(BundleError):
    """The model file's size or SHA-256 differs from the signed manifest."""


class ExpiredError(BundleError):
    """The bundle is past its expiry time (or claims to be created in the future)."""


class RollbackError(BundleError):
    """The bundle's round is not newer than the last accepted one for this model."""


class RuntimeCompatibilityError(BundleError):
    """This onnxruntime is older than the bundle needs, or cannot load the model."""


class ModelSignatureError(BundleError):
    """The model's inputs/outputs differ from the manifest's."""


class GoldenTestError(BundleError):
    """The model does not reproduce the signed golden outputs on this device."""


class InputError(BundleError):
    """An inference input does not match the model's signature (dtype, rank, shape)."""


# ------------------------------------------------------------------------------------------------
# DSSE


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: what is actually signed."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(kind), kind, len(payload), payload)


def _b64decode(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise SignatureError(f"{what} is not a base64 string")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as err:
        raise SignatureError(f"{what} is not valid base64: {err}") from err


def _utc(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_utc(value: Any, what: str) -> float:
    if not isinstance(value, str):
        raise ManifestError(f"{what} must be an RFC 3339 UTC time string")
    try:
        return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()
    except ValueError as err:
        raise ManifestError(f"{what} {value!r} is not of the form YYYY-MM-DDTHH:MM:SSZ") from err


# ------------------------------------------------------------------------------------------------
# writing (cloud side)


def write_bundle(
    out_dir: str | os.PathLike[str],
    model_bytes: bytes,
    predicate: dict[str, Any],
    private_key: Ed25519PrivateKey,
    *,
    valid_days: float = 30.0,
    now: float | None = None,
) -> dict[str, Any]:
    """Sign ``predicate`` about ``model_bytes`` and write the bundle; return the statement.

    ``predicate`` holds the metadata (task, inputs/outputs, round, accuracy, golden data...); the
    model digest, size and the created/expiry times are filled in here so they cannot disagree
    with what is written. The model is written first and the envelope last, each atomically: a
    crash leaves no envelope that vouches for a missing or partial model.
    """
    created = time.time() if now is None else now
    digest = hashlib.sha256(model_bytes).hexdigest()
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": MODEL_FILE, "digest": {"sha256": digest}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            **predicate,
            "model": {"file": MODEL_FILE, "size": len(model_bytes), "sha256": digest},
            "created": _utc(created),
            "expires": _utc(created + valid_days * 86400.0),
        },
    }
    _check_predicate(statement["predicate"])
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode("utf-8")
    signature = private_key.sign(pae(PAYLOAD_TYPE, payload))
    envelope = {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [{"keyid": key_id(private_key.public_key()),
                        "sig": base64.b64encode(signature).decode("ascii")}],
    }
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ENVELOPE_FILE).unlink(missing_ok=True)  # never a stale envelope next to a new model
    atomic_write_bytes(directory / MODEL_FILE, model_bytes, mode=0o644)  # public artifacts
    atomic_write_text(directory / ENVELOPE_FILE, json.dumps(envelope, indent=2) + "\n", mode=0o644)
    return statement


# ------------------------------------------------------------------------------------------------
# verification (edge side)


@dataclass
class AcceptedRounds:
    """Anti-rollback store: the last accepted (round, sha256) per model name, kept on disk.

    Re-verifying the bundle that was accepted last is fine (same round, same digest); any other
    bundle must carry a strictly newer round.
    """

    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    def load(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            # Failing closed: a damaged store must not reopen the door to old bundles.
            raise RollbackError(f"anti-rollback store {self.path} is unreadable ({err}); refusing") from err
        if not isinstance(data, dict):
            raise RollbackError(f"anti-rollback store {self.path} is not a JSON object; refusing")
        return data

    def check(self, name: str, round_: int, sha256: str) -> None:
        last = self.load().get(name)
        if last is None:
            return
        if not (isinstance(last, dict) and isinstance(last.get("round"), int)):
            raise RollbackError(f"anti-rollback store {self.path} has a damaged entry for {name!r}; refusing")
        if round_ == last["round"] and sha256 == last.get("sha256"):
            return
        if round_ <= last["round"]:
            raise RollbackError(
                f"bundle for {name!r} is from round {round_}, not newer than the accepted round {last['round']}"
            )

    def record(self, name: str, round_: int, sha256: str) -> None:
        """Store ``round_`` for ``name``; re-checks first, so the stored round never goes down."""
        self.check(name, round_, sha256)
        data = self.load()
        data[name] = {"round": round_, "sha256": sha256, "accepted": _utc(time.time())}
        atomic_write_text(self.path, json.dumps(data, indent=2, sort_keys=True) + "\n")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold an exclusive lock from check to record: two verifications running at once cannot
        both pass against the same stored round and then write in either order."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass
class VerifiedBundle:
    """A bundle that passed every check, with an onnxruntime session over the verified bytes."""

    directory: Path
    statement: dict[str, Any]
    model_bytes: bytes
    session: Any  # onnxruntime.InferenceSession
    key_id: str
    envelope_bytes: bytes = b""
    seconds: float = 0.0  # verify + load time

    @property
    def predicate(self) -> dict[str, Any]:
        return self.statement["predicate"]

    def check_input(self, x: np.ndarray) -> np.ndarray:
        spec = self.predicate["inputs"][0]
        if not isinstance(x, np.ndarray):
            raise InputError(f"input must be a numpy array, got {type(x).__name__}")
        if x.dtype != np.dtype(spec["dtype"]):
            raise InputError(f"input dtype {x.dtype} differs from the model's {spec['dtype']}")
        expected = spec["shape"]
        if x.ndim != len(expected) or any(
            isinstance(dim, int) and dim != got for dim, got in zip(expected, x.shape)
        ):
            raise InputError(f"input shape {list(x.shape)} does not fit the model's {expected}")
        if not np.isfinite(x).all():
            raise InputError("input contains NaN or infinity")
        return np.ascontiguousarray(x)

    def run(self, x: np.ndarray) -> np.ndarray:
        """Outputs for ``x`` after checking it against the signed input signature."""
        name = self.predicate["inputs"][0]["name"]
        return self.session.run(None, {name: self.check_input(x)})[0]


def install(bundle: VerifiedBundle, root: str | os.PathLike[str]) -> Path:
    """Make a verified bundle the device's active model for its name, atomically.

    The verified bytes (not a re-read of the source directory) go to
    ``root/versions/<name>-r<round>-<sha12>/``; then the symlink ``root/<name>`` is replaced in one
    ``rename``. A reader following the link sees the old model or the new one, never a mixture, and
    a crash mid-install leaves the previous model active.
    """
    predicate = bundle.predicate
    name = re.sub(r"[^A-Za-z0-9._=-]", "_", predicate["name"])
    base = Path(root)
    relative = Path("versions") / f"{name}-r{predicate['round']}-{predicate['model']['sha256'][:12]}"
    target = base / relative
    atomic_write_bytes(target / MODEL_FILE, bundle.model_bytes, mode=0o644)
    atomic_write_bytes(target / ENVELOPE_FILE, bundle.envelope_bytes, mode=0o644)
    link = base / name
    temporary = base / f".{name}.{os.getpid()}.link"
    temporary.unlink(missing_ok=True)
    os.symlink(relative, temporary)
    os.replace(temporary, link)
    return link


_SEMVER = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


def _version(text: str) -> tuple[int, int, int]:
    match = _SEMVER.match(text.strip())
    if not match:
        raise RuntimeCompatibilityError(f"cannot read version {text!r}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def make_session(model_bytes: bytes, *, threads: int = 1, spinning: bool = False) -> Any:
    """An onnxruntime CPU session with edge-appropriate options.

    Few intra-op threads (a phone or a gateway has other work); no spin-waiting when the device also
    trains; all graph optimisations: QDQ int8 models need at least the extended level to fuse into
    integer kernels, and the CPU layout transforms of the full level made both fp32 and int8 about
    1.5-2x faster at batch 64 on this machine (bench/edge.py measures every variant with this session).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.log_severity_level = 3
    return ort.InferenceSession(model_bytes, sess_options=options, providers=["CPUExecutionProvider"])


def _read_regular(path: Path, limit: int, error: type[BundleError]) -> bytes:
    """At most ``limit + 1`` bytes of a regular file, opened without blocking (a FIFO or device in
    its place must not hang or flood the verifier)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise error(f"cannot open {path}: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read(limit + 1)
    finally:
        os.close(fd)


def _open_envelope(directory: Path, trusted: Sequence[Ed25519PublicKey]) -> tuple[dict[str, Any], str, bytes]:
    path = directory / ENVELOPE_FILE
    if not path.exists():
        raise SignatureError(f"no {ENVELOPE_FILE} in {directory}: not a signed bundle")
    raw = _read_regular(path, MAX_ENVELOPE_BYTES, SignatureError)
    if len(raw) > MAX_ENVELOPE_BYTES:
        raise SignatureError(f"{ENVELOPE_FILE} is larger than any Fedge envelope ({MAX_ENVELOPE_BYTES} bytes)")
    try:
        envelope = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise SignatureError(f"{ENVELOPE_FILE} is not usable JSON: {type(err).__name__}") from None
    if not isinstance(envelope, dict) or envelope.get("payloadType") != PAYLOAD_TYPE:
        raise SignatureError(f"envelope payloadType must be {PAYLOAD_TYPE!r}")
    payload = _b64decode(envelope.get("payload"), "envelope payload")
    signatures = envelope.get("signatures")
    if not isinstance(signatures, list) or not signatures:
        raise SignatureError("envelope has no signatures")
    if len(signatures) > MAX_SIGNATURES:  # each one costs an Ed25519 check per trusted key
        raise SignatureError(f"envelope carries {len(signatures)} signatures, at most {MAX_SIGNATURES} are read")
    message = pae(PAYLOAD_TYPE, payload)
    keys = {key_id(k): k for k in trusted}
    if not keys:
        raise SignatureError("no trusted keys given")
    for entry in signatures:
        if not isinstance(entry, dict):
            continue
        try:
            signature = _b64decode(entry.get("sig"), "signature")
        except SignatureError:
            continue  # a malformed entry must not hide a valid one after it
        # Try every trusted key, not only the one the (unauthenticated) keyid names.
        for kid, key in keys.items():
            try:
                key.verify(signature, message)
            except InvalidSignature:
                continue
            try:
                statement = json.loads(payload)
            except (ValueError, RecursionError) as err:  # signed garbage is still garbage
                raise ManifestError(f"signed payload is not usable JSON: {type(err).__name__}") from None
            if not isinstance(statement, dict):
                raise ManifestError("signed payload is not a JSON object")
            return statement, kid, raw
    claimed = [e.get("keyid") for e in signatures if isinstance(e, dict)]
    raise SignatureError(f"no valid signature by a trusted key (signatures claim key ids {claimed})")


def _check_predicate(predicate: Any) -> None:
    if not isinstance(predicate, dict):
        raise ManifestError("predicate must be an object")
    required = {"name": str, "task": str, "round": int, "inputs": list, "outputs": list, "model": dict,
                "runtime": dict, "golden": dict, "created": str, "expires": str}
    for key, kind in required.items():
        if not isinstance(predicate.get(key), kind) or (kind is int and isinstance(predicate.get(key), bool)):
            raise ManifestError(f"predicate field {key!r} missing or not a {kind.__name__}")
    for side in ("inputs", "outputs"):
        for tensor in predicate[side]:
            if not (isinstance(tensor, dict) and isinstance(tensor.get("name"), str)
                    and isinstance(tensor.get("shape"), list) and isinstance(tensor.get("dtype"), str)):
                raise ManifestError(f"{side} entries need name, dtype and shape")
    if len(predicate["inputs"]) != 1 or len(predicate["outputs"]) != 1:
        raise ManifestError("a bundle model has exactly one input and one output")
    for tensor in predicate["inputs"] + predicate["outputs"]:
        if tensor["dtype"] not in _DTYPES:
            raise ManifestError(f"tensor dtype {tensor['dtype']!r} is not one of {_DTYPES}")
    if not _SAFE_NAME.fullmatch(predicate["name"]):
        raise ManifestError(f"model name {predicate['name']!r} must match {_SAFE_NAME.pattern}")
    if predicate["round"] < 0:
        raise ManifestError("round must be >= 0")
    model = predicate["model"]
    if not (isinstance(model.get("size"), int) and 0 < model["size"] <= MAX_MODEL_BYTES
            and isinstance(model.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", model["sha256"]) and model.get("file") == MODEL_FILE):
        raise ManifestError("predicate.model needs file, a size in (0, 2 GiB] and a sha256 hex digest")
    if not isinstance(predicate["runtime"].get("min_onnxruntime"), str):
        raise ManifestError("predicate.runtime.min_onnxruntime missing")
    atol = predicate["golden"].get("atol", 1e-4)
    if isinstance(atol, bool) or not isinstance(atol, int | float) or not (0 <= atol < float("inf")):
        raise ManifestError("golden.atol must be a finite number >= 0")


def _shape_signature(values: Any) -> list[dict[str, Any]]:
    kinds = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(uint8)": "uint8",
             "tensor(int8)": "int8", "tensor(float16)": "float16"}
    return [{"name": v.name, "dtype": kinds.get(v.type, v.type),
             "shape": [d if isinstance(d, int) else None for d in v.shape]} for v in values]


def _signature_matches(declared: list[dict[str, Any]], actual: list[dict[str, Any]]) -> bool:
    if len(declared) != len(actual):
        return False
    for want, got in zip(declared, actual):
        if want["name"] != got["name"] or want["dtype"] != got["dtype"] or len(want["shape"]) != len(got["shape"]):
            return False
        for a, b in zip(want["shape"], got["shape"]):
            if isinstance(a, int) and a != b:  # a named (dynamic) dimension matches anything
                return False
    return True


def _golden_array(data: Any, what: str) -> np.ndarray:
    if not (isinstance(data, dict) and isinstance(data.get("data"), str) and isinstance(data.get("shape"), list)):
        raise ManifestError(f"golden {what} needs base64 float32 data and a shape")
    try:
        raw = base64.b64decode(data["data"], validate=True)
        array = np.frombuffer(raw, dtype="<f4").reshape([int(d) for d in data["shape"]])
    except (ValueError, TypeError) as err:
        raise ManifestError(f"golden {what} is malformed: {err}") from err
    if not np.isfinite(array).all():
        raise ManifestError(f"golden {what} is not finite")
    return array


def encode_golden(array: np.ndarray) -> dict[str, Any]:
    """Golden tensors travel as base64 little-endian float32 with their shape."""
    array = np.ascontiguousarray(array, dtype="<f4")
    return {"shape": list(array.shape), "data": base64.b64encode(array.tobytes()).decode("ascii")}


def read_statement_unverified(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The statement inside an envelope WITHOUT checking the signature: for display and tests only."""
    envelope = json.loads((Path(directory) / ENVELOPE_FILE).read_text(encoding="utf-8"))
    return json.loads(base64.b64decode(envelope["payload"]))


def verify_bundle(
    directory: str | os.PathLike[str],
    trusted_keys: Sequence[Ed25519PublicKey],
    *,
    accepted: AcceptedRounds | None = None,
    now: float | None = None,
    threads: int = 1,
    record: bool = True,
) -> VerifiedBundle:
    """Verify a bundle in the documented order; return it with a session over the verified bytes.

    ``accepted`` is the anti-rollback store (None skips the rollback check: for inspection only).
    With ``record``, a bundle that passes every check has its round recorded there; the store is
    locked from the rollback check to the record.
    """
    if accepted is None:
        return _verify(directory, trusted_keys, None, now, threads, record)
    with accepted.locked():
        return _verify(directory, trusted_keys, accepted, now, threads, record)


def _verify(
    directory: str | os.PathLike[str],
    trusted_keys: Sequence[Ed25519PublicKey],
    accepted: AcceptedRounds | None,
    now: float | None,
    threads: int,
    record: bool,
) -> VerifiedBundle:
    started = time.perf_counter()
    folder = Path(directory)
    statement, kid, envelope_bytes = _open_envelope(folder, trusted_keys)
    if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != PREDICATE_TYPE:
        raise ManifestError("not an in-toto v1 statement with the Fedge bundle predicate")
    predicate = statement.get("predicate")
    _check_predicate(predicate)
    subject = statement.get("subject")
    model = predicate["model"]
    if not (isinstance(subject, list) and len(subject) == 1 and isinstance(subject[0], dict)
            and subject[0].get("name") == MODEL_FILE
            and subject[0].get("digest") == {"sha256": model["sha256"]}):
        raise ManifestError("statement subject must name model.onnx with the predicate's sha256")

    # 3. integrity over the bytes we will actually load (read once, never re-opened)
    model_bytes = _read_regular(folder / MODEL_FILE, model["size"], IntegrityError)
    if len(model_bytes) != model["size"]:
        raise IntegrityError(f"{MODEL_FILE} has {len(model_bytes)}+ bytes, the manifest says {model['size']}")
    digest = hashlib.sha256(model_bytes).hexdigest()
    if digest != model["sha256"]:
        raise IntegrityError(f"{MODEL_FILE} sha256 {digest[:16]}… differs from the signed {model['sha256'][:16]}…")

    # 4. time window
    clock = time.time() if now is None else now
    created, expires = _parse_utc(predicate["created"], "created"), _parse_utc(predicate["expires"], "expires")
    if clock > expires:
        raise ExpiredError(f"bundle expired at {predicate['expires']}")
    if created > clock + 300:  # five minutes of clock skew
        raise ExpiredError(f"bundle claims to be created in the future ({predicate['created']})")

    # 5. anti-rollback
    if accepted is not None:
        accepted.check(predicate["name"], predicate["round"], digest)

    # 6. runtime compatibility
    import onnxruntime as ort

    needed = predicate["runtime"]["min_onnxruntime"]
    if _version(ort.__version__) < _version(needed):
        raise RuntimeCompatibilityError(f"bundle needs onnxruntime >= {needed}, this device has {ort.__version__}")
    try:
        session = make_session(model_bytes, threads=threads)
    except Exception as err:  # onnxruntime raises its own Fail/InvalidGraph/... types
        raise RuntimeCompatibilityError(f"onnxruntime {ort.__version__} cannot load the model: {err}") from err

    # 7. signature of the loaded model vs the manifest
    inputs, outputs = _shape_signature(session.get_inputs()), _shape_signature(session.get_outputs())
    if not (_signature_matches(predicate["inputs"], inputs) and _signature_matches(predicate["outputs"], outputs)):
        raise ModelSignatureError(
            f"model signature {inputs} -> {outputs} differs from the manifest's "
            f"{predicate['inputs']} -> {predicate['outputs']}"
        )

    # 8. golden self-test
    bundle = VerifiedBundle(folder, statement, model_bytes, session, kid, envelope_bytes)
    golden = predicate["golden"]
    x, expected = _golden_array(golden.get("inputs"), "inputs"), _golden_array(golden.get("outputs"), "outputs")
    tolerance = float(golden.get("atol", 1e-4))
    try:
        got = bundle.run(x)
    except InputError as err:
        raise GoldenTestError(f"golden inputs do not fit the model: {err}") from err
    if got.shape != expected.shape:
        raise GoldenTestError(f"golden output shape {got.shape} differs from the signed {expected.shape}")
    error = float(np.max(np.abs(got - expected))) if got.size else 0.0
    if not np.isfinite(got).all() or error > tolerance or (
        got.ndim == 2 and not np.array_equal(got.argmax(1), expected.argmax(1))
    ):
        raise GoldenTestError(f"golden self-test failed: max |error| {error:.3g} > {tolerance:.3g} or labels differ")

    if accepted is not None and record:
        accepted.record(predicate["name"], predicate["round"], digest)
    bundle.seconds = time.perf_counter() - started
    log.info("bundle %s round %d verified (key %s…) in %.1f ms", predicate["name"], predicate["round"],
             kid[:12], bundle.seconds * 1e3)
    return bundle


@dataclass
class LatencyReport:
    """Inference latency of a verified bundle on this device."""

    batch: int
    runs: int
    p50_ms: float
    p90_ms: float
    samples_per_s: float
    timings_ms: list[float] = field(default_factory=list, repr=False)


def measure_latency(bundle: VerifiedBundle, x: np.ndarray, *, runs: int = 50, warmup: int = 5) -> LatencyReport:
    x = bundle.check_input(x)
    name = bundle.predicate["inputs"][0]["name"]
    for _ in range(warmup):
        bundle.session.run(None, {name: x})
    timings = []
    for _ in range(runs):
        start = time.perf_counter()
        bundle.session.run(None, {name: x})
        timings.append((time.perf_counter() - start) * 1e3)
    p50 = float(np.percentile(timings, 50))
    return LatencyReport(batch=x.shape[0], runs=runs, p50_ms=p50, p90_ms=float(np.percentile(timings, 90)),
                         samples_per_s=x.shape[0] / (p50 / 1e3), timings_ms=timings)
