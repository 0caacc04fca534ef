"""ONNX export with torch's dynamo exporter: one self-contained, reproducible file.

``torch.onnx.export(dynamo=True)`` (torch 2.13's default) gives opset 20 / IR 10 with a dynamic
batch axis. Its nodes carry Python stack traces, FX node text and module paths: absolute build
paths that leak the build machine and make two exports of the same weights differ. We strip every
``metadata_props`` and ``doc_string``; the result is byte-identical across runs (tested), checked
by ``onnx.checker`` and compared with PyTorch's outputs through onnxruntime.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from torch import nn

__all__ = ["ExportError", "OnnxModel", "export_onnx", "min_onnxruntime", "model_versions", "parity_error", "strip_metadata"]

log = logging.getLogger(__name__)

INPUT_NAME = "x"
OUTPUT_NAME = "logits"

# The first onnxruntime release that runs a given opset (https://onnxruntime.ai/docs/reference/compatibility.html).
_ORT_FOR_OPSET = {17: "1.13", 18: "1.14", 19: "1.15", 20: "1.17", 21: "1.18", 22: "1.21", 23: "1.22"}
_ORT_FOR_IR = {8: "1.14", 9: "1.15", 10: "1.18", 11: "1.22"}


class ExportError(RuntimeError):
    """The model cannot be exported faithfully (checker failure, parity mismatch)."""


@dataclass(frozen=True)
class OnnxModel:
    data: bytes
    opset: int
    ir_version: int


def strip_metadata(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop exporter metadata (stack traces, FX text, module paths) from every node and value."""

    def clean_graph(graph: onnx.GraphProto) -> None:
        graph.doc_string = ""
        del graph.metadata_props[:]
        for value in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
            del value.metadata_props[:]
            value.doc_string = ""
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    clean_graph(attribute.g)
                for sub in attribute.graphs:
                    clean_graph(sub)

    clean_graph(model.graph)
    for function in model.functions:
        del function.metadata_props[:]
        function.doc_string = ""
        for node in function.node:
            del node.metadata_props[:]
            node.doc_string = ""
    del model.metadata_props[:]
    model.doc_string = ""
    return model


def model_versions(data: bytes) -> tuple[int, int]:
    """(default-domain opset, IR version) of a serialized model."""
    proto = onnx.load_from_string(data)
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), proto.ir_version


def min_onnxruntime(opset: int, ir_version: int) -> str:
    """The oldest onnxruntime that supports both the opset and the IR version."""
    if opset not in _ORT_FOR_OPSET or ir_version not in _ORT_FOR_IR:
        raise ExportError(f"opset {opset} / IR {ir_version}: no known onnxruntime minimum")
    versions = [_ORT_FOR_OPSET[opset], _ORT_FOR_IR[ir_version]]
    return max(versions, key=lambda v: tuple(int(p) for p in v.split(".")))


def export_onnx(model: nn.Module, example: torch.Tensor, output_name: str = OUTPUT_NAME) -> OnnxModel:
    """Export ``model`` (eval mode, CPU) with a dynamic batch axis; weights inside the one file."""
    model = model.eval().cpu()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        exporter_log = logging.getLogger("torch.onnx")
        level = exporter_log.level
        exporter_log.setLevel(logging.ERROR)  # "torchvision is not installed" notices
        try:
            program = torch.onnx.export(
                # a batch of two: torch.export specializes a batch dimension of size 1 (its 0/1
                # rule), and some modules (recurrent layers) then bake batch 1 into the graph
                model, (torch.cat([example[:1], example[:1]]).cpu(),), dynamo=True, input_names=[INPUT_NAME],
                output_names=[output_name],
                dynamic_shapes=({0: torch.export.Dim("batch")},), external_data=False,
                verbose=False,
            )
        finally:
            exporter_log.setLevel(level)
    if program is None:
        raise ExportError("torch.onnx.export returned no program")
    proto = strip_metadata(program.model_proto)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as err:
        raise ExportError(f"onnx.checker rejected the export: {err}") from err
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    return OnnxModel(proto.SerializeToString(), opset, proto.ir_version)


def parity_error(model: nn.Module, onnx_bytes: bytes, x: torch.Tensor) -> float:
    """Largest |PyTorch - onnxruntime| over ``x``: an export must not change the function."""
    from fedge.deploy.bundle import make_session

    with torch.no_grad():
        expected = model.eval()(x).numpy()
    got = make_session(onnx_bytes).run(None, {INPUT_NAME: x.numpy().astype(np.float32)})[0]
    return float(np.max(np.abs(expected - got)))
