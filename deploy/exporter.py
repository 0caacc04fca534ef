"""From an fp32 model file to a signed edge bundle: prune → export → quantize → gate → sign.

``fedge export CHECKPOINT --prune ... --quantize int8 --sign-key KEY --out DIR`` and the
coordinator's ``--export-bundle`` both call :func:`export_bundle`. Every figure in the manifest's
``quality`` section is the task's primary metric (accuracy, or the task's own: MSE, ...), measured
here on the task's held-out data (a task without central data: a seeded sample of its training
pool, said so in the manifest): the checkpoint in PyTorch, the exported fp32 model and the final
model in onnxruntime. The int8 model is refused (nothing is written) if it is worse than the fp32
model it was quantized from by more than ``max_accuracy_drop``: points of accuracy, or percent of
the fp32 value for any other metric.
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
from fedge.tasks import Task, TensorData, as_tensor_data, chance_accuracy, evaluate, make_task
from fedge.tasks.base import subset

__all__ = ["EXPORT_REFUSALS", "AccuracyGateError", "ExportOptions", "bundle_facts", "export_bundle", "onnx_accuracy",
           "onnx_metrics", "resolve_model_file"]

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
    #: the worst primary metric a bundle may have (None: for accuracy, better than always answering
    #: the held-out set's most common class; other metrics, no floor)
    min_quality: float | None = None

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"--quantize must be one of {QUANTIZE_MODES}, got {self.quantize!r}")
        if self.max_accuracy_drop < 0 or self.valid_days <= 0 or self.golden_samples < 1:
            raise ValueError("max accuracy drop must be >= 0, validity > 0 days, golden samples >= 1")


def resolve_model_file(path: str | os.PathLike[str]) -> Path:
    """A model file, or a run / cloud-train directory holding ``model.pt``."""
    candidate = Path(path)
    return candidate / "model.pt" if candidate.is_dir() else candidate


def onnx_metrics(session: Any, x: np.ndarray, y: np.ndarray, task: Task, batch: int = 256) -> dict[str, float]:
    """The task's loss and metrics of an onnxruntime session on ``(x, y)``."""
    outputs = [session.run(None, {INPUT_NAME: np.ascontiguousarray(x[start : start + batch], np.float32)})[0]
               for start in range(0, len(x), batch)]
    out, target = torch.from_numpy(np.concatenate(outputs)), torch.from_numpy(y)
    with torch.no_grad():
        return {"loss": float(task.loss(out, target)), **task.metrics(out, target)}


def onnx_accuracy(session: Any, x: np.ndarray, y: np.ndarray, batch: int = 256) -> float:
    """Classification accuracy of a session (the edge benchmark's figure)."""
    correct = 0
    for start in range(0, len(x), batch):
        logits = session.run(None, {INPUT_NAME: np.ascontiguousarray(x[start : start + batch], np.float32)})[0]
        correct += int((logits.argmax(1) == y[start : start + batch]).sum())
    return correct / len(x)


def bundle_facts(statement: dict[str, Any]) -> dict[str, Any]:
    """The figures of a written bundle that a person or a run summary reports (from its signed
    statement): ``accuracy``, ``fp32_accuracy``, ``checkpoint_accuracy`` for a classifier, the same
    with the task's metric name otherwise (``mse``, ``fp32_mse``, ...)."""
    predicate = statement["predicate"]
    quality = predicate["quality"]
    metric = quality["metric"]
    return {"name": predicate["name"], "round": predicate["round"], "bytes": predicate["model"]["size"],
            "quantization": predicate["quantization"]["mode"], "pruning": predicate["pruning"]["spec"],
            "metric": metric, metric: quality["bundle"], f"fp32_{metric}": quality["fp32"],
            f"checkpoint_{metric}": quality["checkpoint_fp32"], "expires": predicate["expires"]}


def _allowed_drop(task: Task, max_drop: float, samples: int) -> float:
    """The drop the gate allows: ``max_drop``, but for accuracy never less than one sample's worth.

    Accuracy on n samples moves in steps of 100/n points. A gate finer than one step (1 point on the
    45 held-out samples of a 178-sample task) would refuse any single changed prediction, which int8
    rounding flips from one run to the next; such a gate measures the set's size, not the model. So
    the smallest allowed drop is one sample; a set of 100/max_drop samples or more is unaffected."""
    if task.primary_metric != "accuracy" or samples <= 0:
        return max_drop
    step = 100.0 / samples
    return max(max_drop, step * (1 + 1e-9)) if max_drop > 0 else max_drop


def _check_floor(task: Task, score: float, targets: torch.Tensor, floor: float | None) -> None:
    """Refuse a model no better than ``floor``: by default, for accuracy, the rate of always
    answering the held-out set's most common class. A run whose learning rate was scaled past what
    the model takes ends at chance (10% on Fashion-MNIST), and the gate between int8 and fp32 alone
    signed it; a model at chance is never signed."""
    metric, what = task.primary_metric, "--min-quality"
    if floor is None:
        floor = chance_accuracy(task, targets)
        what = "the rate of always answering the held-out set's most common class"
        if floor is None:
            return
    bad = score <= floor if task.maximize else score >= floor
    if bad:
        raise AccuracyGateError(f"the model's {metric} {score:.4g} is no better than {floor:.4g} ({what}): it did "
                                "not learn; no bundle written (check the run's learning rate and warm-up)")


def _worse_by(task: Task, fp32: float, final: float) -> float:
    """How much worse ``final`` is than ``fp32``: accuracy points, else percent of the fp32 value."""
    if task.primary_metric == "accuracy":
        return 100.0 * (fp32 - final)
    change = (fp32 - final) if task.maximize else (final - fp32)
    return 100.0 * change / max(abs(fp32), 1e-12)


def _evaluation_split(task: Task, pool: Any, seed: int, limit: int = 10_000) -> tuple[TensorData, str]:
    """The samples the export is measured on: the task's central split, or (a task without one) a
    seeded sample of its training pool."""
    test = task.test_data()
    if test is not None:
        return as_tensor_data(test, limit), "held-out"
    picked = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[: min(limit, 1000)]
    return as_tensor_data(subset(pool, picked.tolist())), "training sample (the task has no held-out split)"


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
    pool = task.train_pool()
    test, measured_on = _evaluation_split(task, pool, options.seed)
    metric = task.primary_metric
    checkpoint_score = evaluate(model, test, task)[metric]

    torch.manual_seed(options.seed)
    pruned = apply_pruning(model, options.prune, pool, task, fine_tune_epochs=options.fine_tune_epochs,
                           seed=options.seed)
    fp32 = export_onnx(model, task.example_input(), task.output)
    parity = parity_error(model, fp32.data, test.x[:64])
    if parity > 1e-3:
        raise ExportError(f"ONNX export differs from PyTorch by {parity:.3g}: refusing to ship it")
    x_test, y_test = test.x.numpy(), test.y.numpy()
    fp32_score = onnx_metrics(make_session(fp32.data), x_test, y_test, task)[metric]
    _check_floor(task, fp32_score, test.y, options.min_quality)

    final = fp32.data
    quantization: dict[str, Any] = {"mode": options.quantize}
    if options.quantize != "none":
        if options.quantize == "int8":
            if calibration is None:
                generator = torch.Generator().manual_seed(options.seed)
                picked = torch.randperm(len(pool), generator=generator)[: options.calibration_samples]
                calibration = as_tensor_data(subset(pool, picked.tolist())).x.numpy()
            final = quantize_static_int8(fp32.data, calibration)
            quantization |= {"format": "QDQ", "weights": "int8 per-channel, 7-bit range", "activations": "uint8",
                             "calibration": "MinMax", "calibration_samples": len(calibration),
                             "fp32_layers": ["first compute layer"]}
        else:
            final = quantize_dynamic_int8(fp32.data)
            quantization |= {"weights": "int8 per-tensor, 7-bit range", "activations": "dynamic uint8"}
    session = make_session(final)
    final_score = onnx_metrics(session, x_test, y_test, task)[metric]
    drop = _worse_by(task, fp32_score, final_score)
    allowed = _allowed_drop(task, options.max_accuracy_drop, len(y_test))
    if allowed > options.max_accuracy_drop:
        log.warning("%d held-out samples resolve %.2f accuracy points: the gate allows one sample (%.2f points) "
                    "rather than %s", len(y_test), 100.0 / len(y_test), allowed, options.max_accuracy_drop)
    if drop > allowed:
        unit = "points" if metric == "accuracy" else "% of the fp32 value"
        raise AccuracyGateError(
            f"{options.quantize} model {metric} {final_score:.4g} is worse than fp32 {fp32_score:.4g} by "
            f"{drop:.2f} {unit} (allowed: {allowed:.4g} on {len(y_test)} samples); no bundle written"
        )

    golden_x = x_test[: options.golden_samples].astype(np.float32)
    golden_y = session.run(None, {INPUT_NAME: golden_x})[0]
    scale = float(np.max(np.abs(golden_y))) or 1.0
    # Same bytes, other CPUs: fp32 kernels agree to rounding, int8 kernels (VNNI or not) may differ
    # by a few quantization steps.
    atol = (0.05 if options.quantize != "none" else 1e-4) * max(1.0, scale)
    opset, ir_version = model_versions(final)
    import onnxruntime

    inputs = [{"name": INPUT_NAME, "dtype": "float32", "shape": ["batch", *list(test.x.shape[1:])]}]
    outputs = [{"name": task.output, "dtype": "float32", "shape": ["batch", *list(golden_y.shape[1:])]}]
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
        "quality": {
            "metric": metric,
            "greater_is_better": task.maximize,
            "measured_on": measured_on,
            "samples": len(y_test),
            "checkpoint_fp32": checkpoint_score,
            "fp32": fp32_score,
            "bundle": final_score,
            "max_drop": options.max_accuracy_drop,
            "allowed_drop": round(allowed, 6),  # max_drop, or one sample where the set resolves less
            "max_drop_unit": "points" if metric == "accuracy" else "percent of fp32",
        },
        "source": {"model_file_sha256": source_sha, "metadata": _json_safe(model_file.metadata)},
        "golden": {"inputs": encode_golden(golden_x), "outputs": encode_golden(golden_y), "atol": atol},
    }
    statement = write_bundle(out_dir, final, predicate, private_key, valid_days=options.valid_days)
    log.info("bundle %s: %s, %d bytes, %s %.4g (fp32 %.4g, checkpoint %.4g)", out_dir, options.quantize,
             len(final), metric, final_score, fp32_score, checkpoint_score)
    return statement


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
