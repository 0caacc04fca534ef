"""From an fp32 model file to a signed edge bundle: prune → export → quantize → gate → sign.

``fedge export CHECKPOINT --prune ... --quantize int8 --sign-key KEY --out DIR`` and the
coordinator's ``--export-bundle`` both call :func:`export_bundle`. Every accuracy in the manifest is
measured here on the task's held-out data: the checkpoint in PyTorch, the exported fp32 model and
the final model in onnxruntime. The int8 model is refused (nothing is written) if it loses more
than ``max_accuracy_drop`` points against the fp32 model it was quantized from.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.deploy.bundle import encode_golden, make_session, write_bundle
from fedge.deploy.model_file import ModelFile, ModelFileError, load_model_file
from fedge.deploy.onnx_export import (
    INPUT_NAME,
    ExportError,
    export_onnx,
    min_onnxruntime,
    model_versions,
    parity_error,
)
from fedge.deploy.prune import apply_pruning
from fedge.deploy.quantize import QuantizationError, quantize_dynamic_int8, quantize_static_int8
from fedge.tasks import evaluate, make_task

__all__ = ["EXPORT_REFUSALS", "AccuracyGateError", "ExportOptions", "bundle_facts", "export_bundle", "onnx_accuracy",
           "resolve_model_file"]

log = logging.getLogger(__name__)

QUANTIZE_MODES = ("int8", "dynamic-int8", "none")


class AccuracyGateError(RuntimeError):
    """The quantized model lost more accuracy than allowed; no bundle was written."""


#: what "this model must not ship" looks like (accuracy gate, export, quantization): the caller
#: reports it and nothing was written; anything else is a bug
EXPORT_REFUSALS: tuple[type[Exception], ...] = (AccuracyGateError, ExportError, QuantizationError)


@dataclass(frozen=True)
class ExportOptions:
    prune: str = ""
    quantize: str = "int8"
    max_accuracy_drop: float = 1.0  # points, int8 vs the fp32 model it was quantized from
    fine_tune_epochs: int = 3
    calibration_samples: int = 256
    golden_samples: int = 8
    valid_days: float = 30.0
    name: str = ""  # model name for anti-rollback; default: the task spec
    round: int | None = None  # default: the model file's training round
    seed: int = 0

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"--quantize must be one of {QUANTIZE_MODES}, got {self.quantize!r}")
        if self.max_accuracy_drop < 0 or self.valid_days <= 0 or self.golden_samples < 1:
            raise ValueError("max accuracy drop must be >= 0, validity > 0 days, golden samples >= 1")


def resolve_model_file(path: str | os.PathLike[str]) -> Path:
    """A model file, or a run / cloud-train directory holding ``model.pt``."""
    candidate = Path(path)
    return candidate / "model.pt" if candidate.is_dir() else candidate


def onnx_accuracy(session: Any, x: np.ndarray, y: np.ndarray, batch: int = 256) -> float:
    correct = 0
    for start in range(0, len(x), batch):
        logits = session.run(None, {INPUT_NAME: np.ascontiguousarray(x[start : start + batch], np.float32)})[0]
        correct += int((logits.argmax(1) == y[start : start + batch]).sum())
    return correct / len(x)


def bundle_facts(statement: dict[str, Any]) -> dict[str, Any]:
    """The figures of a written bundle that a person or a run summary reports (from its signed statement)."""
    predicate = statement["predicate"]
    accuracy = predicate["accuracy"]
    return {"name": predicate["name"], "round": predicate["round"], "bytes": predicate["model"]["size"],
            "quantization": predicate["quantization"]["mode"], "pruning": predicate["pruning"]["spec"],
            "accuracy": accuracy["bundle"], "fp32_accuracy": accuracy["fp32"],
            "checkpoint_accuracy": accuracy["checkpoint_fp32"], "expires": predicate["expires"]}


def export_bundle(
    model_file: ModelFile | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    private_key: Ed25519PrivateKey,
    options: ExportOptions = ExportOptions(),
    *,
    calibration: np.ndarray | None = None,
) -> dict[str, Any]:
    """Build, gate, sign and write a bundle; return the signed statement.

    ``calibration`` overrides the calibration samples (default: a seeded random subset of the
    task's training pool). Unrepresentative calibration data is what the accuracy gate catches.
    """
    for noisy in ("onnxscript", "onnx_ir", "onnxruntime.quantization"):  # per-pass INFO chatter
        if logging.getLogger(noisy).level == logging.NOTSET:
            logging.getLogger(noisy).setLevel(logging.WARNING)
    source_sha = None
    if not isinstance(model_file, ModelFile):
        path = resolve_model_file(model_file)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ModelFileError(f"cannot read model file {path}: {err}") from None
        source_sha = hashlib.sha256(data).hexdigest()
        model_file = load_model_file(path, data)
    task = make_task(model_file.task)
    model = task.build_model()
    model.load_state_dict(model_file.state_dict)
    model.eval()
    test, pool = task.test_data(), task.train_pool()
    _, checkpoint_accuracy = evaluate(model, test)

    torch.manual_seed(options.seed)
    pruned = apply_pruning(model, options.prune, pool, fine_tune_epochs=options.fine_tune_epochs, seed=options.seed)
    fp32 = export_onnx(model, pool.x[:1])
    parity = parity_error(model, fp32.data, test.x[:64])
    if parity > 1e-3:
        raise ExportError(f"ONNX export differs from PyTorch by {parity:.3g}: refusing to ship it")
    x_test, y_test = test.x.numpy(), test.y.numpy()
    fp32_accuracy = onnx_accuracy(make_session(fp32.data), x_test, y_test)

    final = fp32.data
    quantization: dict[str, Any] = {"mode": options.quantize}
    if options.quantize != "none":
        if options.quantize == "int8":
            if calibration is None:
                generator = torch.Generator().manual_seed(options.seed)
                picked = torch.randperm(len(pool), generator=generator)[: options.calibration_samples]
                calibration = pool.x[picked].numpy()
            final = quantize_static_int8(fp32.data, calibration)
            quantization |= {"format": "QDQ", "weights": "int8 per-channel", "activations": "uint8",
                             "calibration": "MinMax", "calibration_samples": len(calibration),
                             "fp32_layers": ["first compute layer"]}
        else:
            final = quantize_dynamic_int8(fp32.data)
            quantization |= {"weights": "int8 per-tensor", "activations": "dynamic uint8"}
    session = make_session(final)
    final_accuracy = onnx_accuracy(session, x_test, y_test)
    drop = 100.0 * (fp32_accuracy - final_accuracy)
    if drop > options.max_accuracy_drop:
        raise AccuracyGateError(
            f"{options.quantize} model accuracy {final_accuracy:.2%} is {drop:.2f} points below fp32 "
            f"{fp32_accuracy:.2%} (allowed: {options.max_accuracy_drop} points); no bundle written"
        )

    golden_x = x_test[: options.golden_samples].astype(np.float32)
    golden_y = session.run(None, {INPUT_NAME: golden_x})[0]
    scale = float(np.max(np.abs(golden_y))) or 1.0
    # Same bytes, other CPUs: fp32 kernels agree to rounding, int8 kernels (VNNI or not) may differ
    # by a few quantization steps; labels must agree in both cases.
    atol = (0.05 if options.quantize != "none" else 1e-4) * max(1.0, scale)
    opset, ir_version = model_versions(final)
    import onnxruntime

    inputs = [{"name": INPUT_NAME, "dtype": "float32", "shape": ["batch", *list(test.x.shape[1:])]}]
    outputs = [{"name": "logits", "dtype": "float32", "shape": ["batch", task.num_classes]}]
    predicate = {
        "name": options.name or task.spec,
        "task": task.spec,
        "round": int(options.round if options.round is not None else model_file.metadata.get("round", 0)),
        "inputs": inputs,
        "outputs": outputs,
        "onnx": {"opset": opset, "ir_version": ir_version},
        "runtime": {"min_onnxruntime": min_onnxruntime(opset, ir_version),
                    "exported_with": {"onnxruntime": onnxruntime.__version__, "torch": torch.__version__}},
        "pruning": {"spec": options.prune or "none", "fine_tune_epochs": options.fine_tune_epochs,
                    **asdict(pruned)},
        "quantization": quantization,
        "accuracy": {
            "held_out_samples": len(y_test),
            "checkpoint_fp32": checkpoint_accuracy,
            "fp32": fp32_accuracy,
            "bundle": final_accuracy,
            "max_drop_points": options.max_accuracy_drop,
        },
        "source": {"model_file_sha256": source_sha, "metadata": _json_safe(model_file.metadata)},
        "golden": {"inputs": encode_golden(golden_x), "outputs": encode_golden(golden_y), "atol": atol},
    }
    statement = write_bundle(out_dir, final, predicate, private_key, valid_days=options.valid_days)
    log.info("bundle %s: %s, %d bytes, accuracy %.2f%% (fp32 %.2f%%, checkpoint %.2f%%)", out_dir,
             options.quantize, len(final), 100 * final_accuracy, 100 * fp32_accuracy, 100 * checkpoint_accuracy)
    return statement


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
