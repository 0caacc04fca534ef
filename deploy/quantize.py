"""int8 quantization with ``onnxruntime.quantization``.

Static QDQ (the default): per-channel int8 weights, uint8 activations (U8S8, fast on x86), ranges
calibrated (MinMax) on representative training samples. onnxruntime fuses the QDQ pairs into
integer kernels when the session runs with extended graph optimisations. Dynamic quantization is
offered only for models whose compute is MatMul/Gemm: on convolutions it yields ConvInteger,
which measured slower than fp32 here (../shared/reference/DEPLOY.md).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx

__all__ = ["QuantizationError", "first_compute_node", "matmul_only", "quantize_dynamic_int8", "quantize_static_int8"]

log = logging.getLogger(__name__)

_COMPUTE_OPS = {"Conv", "ConvTranspose", "MatMul", "Gemm", "LSTM", "GRU", "RNN", "Attention"}


class QuantizationError(RuntimeError):
    """The model cannot be quantized as asked."""


def matmul_only(data: bytes) -> bool:
    """True when every compute-heavy op is MatMul or Gemm (dynamic int8 pays off only there)."""
    ops = {node.op_type for node in onnx.load_from_string(data).graph.node}
    return bool(ops & _COMPUTE_OPS) and ops & _COMPUTE_OPS <= {"MatMul", "Gemm"}


class _Calibration:
    """onnxruntime's CalibrationDataReader protocol over a float32 array, in small batches."""

    def __init__(self, input_name: str, samples: np.ndarray, batch: int = 32) -> None:
        self._batches: Iterator[np.ndarray] = iter(
            [np.ascontiguousarray(samples[i : i + batch], dtype=np.float32) for i in range(0, len(samples), batch)]
        )
        self._name = input_name

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else {self._name: batch}

    def rewind(self) -> None:  # not needed for MinMax; part of the protocol
        raise NotImplementedError


def _input_name(data: bytes) -> str:
    graph = onnx.load_from_string(data).graph
    initializers = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initializers]
    if len(names) != 1:
        raise QuantizationError(f"expected one model input, found {names}")
    return names[0]


def first_compute_node(data: bytes) -> str | None:
    """Name of the first Conv/MatMul/Gemm in graph order (the layer that reads the raw input)."""
    for node in onnx.load_from_string(data).graph.node:
        if node.op_type in _COMPUTE_OPS:
            return node.name
    return None


def quantize_static_int8(
    data: bytes, calibration: np.ndarray, *, per_channel: bool = True, keep_first_fp32: bool = True,
    reduce_range: bool = True,
) -> bytes:
    """Static QDQ int8 of an fp32 ONNX model, calibrated on ``calibration`` (N, ...) float32 samples.

    ``keep_first_fp32`` leaves the first compute layer in float: on an image with one channel it
    does few multiply-adds per output, so int8 saves nothing there while the quantize step on the
    raw input costs. Measured on the 38k-parameter digits CNN at batch 64: all-int8 1.50x faster
    than fp32, first layer kept 2.03x, same accuracy.

    ``reduce_range`` keeps the weights in 7 bits ([-64, 63]). onnxruntime multiplies uint8
    activations by int8 weights with an instruction that adds pairs of products into int16 on an
    x86 CPU without VNNI (SSE4.1, AVX2, AVX-512 before VNNI), and a pair of full-range products
    saturates it. A bundle is made on one machine and runs on devices nobody has seen, so it is
    made exact on all of them: on an AVX2 AMD EPYC a GRU's int8 MAE was 152% above fp32 with 8-bit
    weights and within 5% with 7 (``tests/deploy/test_ddp_training.py``); the digits CNN lost at
    most one of 360 held-out images to it, in two seeds (bench/results/NOTEBOOK.md, 2026-12-01).
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if len(calibration) < 16:
        raise QuantizationError(f"need at least 16 calibration samples, got {len(calibration)}")
    if not np.isfinite(calibration).all():
        raise QuantizationError("calibration samples contain NaN or infinity")
    with tempfile.TemporaryDirectory(prefix="fedge-quant-") as tmp:
        source, prepared, target = Path(tmp, "fp32.onnx"), Path(tmp, "prepared.onnx"), Path(tmp, "int8.onnx")
        source.write_bytes(data)
        # Shape inference + graph cleanup first, as onnxruntime recommends before quantizing.
        quant_pre_process(str(source), str(prepared), skip_symbolic_shape=False)
        first = first_compute_node(prepared.read_bytes()) if keep_first_fp32 else None
        quantize_static(
            str(prepared), str(target), _Calibration(_input_name(data), calibration),
            quant_format=QuantFormat.QDQ, per_channel=per_channel,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax, nodes_to_exclude=[first] if first else [],
            reduce_range=reduce_range,
        )
        return _strip(target.read_bytes())


def quantize_dynamic_int8(data: bytes) -> bytes:
    """Dynamic int8 (weights int8 in a 7-bit range, as :func:`quantize_static_int8` keeps them, for
    the same reason; activations quantized at run time): MatMul-only models only."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if not matmul_only(data):
        raise QuantizationError(
            "dynamic int8 turns convolutions into ConvInteger, slower than fp32 on CPU: use static int8"
        )
    proto = onnx.load_from_string(data)
    # Dynamo exports carry value_info for weights; onnxruntime's shape inference then trips on
    # Gemm(transB=1) (onnxruntime#25890). Dropping those entries avoids it.
    initializers = {i.name for i in proto.graph.initializer}
    kept = [v for v in proto.graph.value_info if v.name not in initializers]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(kept)
    with tempfile.TemporaryDirectory(prefix="fedge-quant-") as tmp:
        source, target = Path(tmp, "fp32.onnx"), Path(tmp, "int8.onnx")
        source.write_bytes(proto.SerializeToString())
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=False, reduce_range=True)
        return _strip(target.read_bytes())


def _strip(data: bytes) -> bytes:
    from fedge.deploy.onnx_export import strip_metadata

    proto = strip_metadata(onnx.load_from_string(data))
    onnx.checker.check_model(proto)
    return proto.SerializeToString()
