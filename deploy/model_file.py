"""The fp32 model file (``model.pt``) shared by the cloud trainer, the coordinator and the exporter.

It holds the task spec (so a reader knows which architecture the weights belong to), the state dict
and free-form provenance metadata. Loading uses ``torch.load(weights_only=True)``: a model file from
elsewhere cannot execute code.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedge.deploy.atomic import atomic_torch_save

__all__ = ["FORMAT", "ModelFile", "ModelFileError", "load_model_file", "save_model_file"]

FORMAT = "fedge.model/1"


class ModelFileError(ValueError):
    """A model file is missing, unreadable or not a Fedge model file."""


@dataclass
class ModelFile:
    task: str
    state_dict: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)


def save_model_file(path: str | os.PathLike[str], model: ModelFile) -> None:
    atomic_torch_save(
        path,
        {
            "format": FORMAT,
            "task": model.task,
            "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict.items()},
            "metadata": dict(model.metadata),
        },
    )


def load_model_file(path: str | os.PathLike[str], data: bytes | None = None) -> ModelFile:
    """Load a model file; with ``data``, parse those bytes (already read from ``path``) instead, so
    a caller that hashed them loads exactly what it hashed."""
    file = Path(path)
    if data is None and not file.is_file():
        raise ModelFileError(f"no model file at {file}")
    try:
        raw = torch.load(io.BytesIO(data) if data is not None else file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several unrelated types for corrupt files
        raise ModelFileError(f"{file} is not a readable model file: {err}") from err
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ModelFileError(f"{file} is not a {FORMAT} file")
    state = raw.get("state_dict")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelFileError(f"{file} has no valid state_dict")
    return ModelFile(task=str(raw.get("task")), state_dict=state, metadata=dict(raw.get("metadata") or {}))
