"""Where a model and its batches live: one rule for the trainers, evaluation and export.

A model on a GPU fed CPU batches fails at its first layer ("Input type (torch.FloatTensor) and
weight type (torch.cuda.FloatTensor) should be the same"); that was every GPU run's first held-out
evaluation. So whoever runs a model asks :func:`model_device` where it is and sends each batch
there with :func:`to_device`; outputs that metrics read come back with :func:`to_host`. CPU tests
catch a batch sent to the wrong place by putting a model's parameters on the ``meta`` device.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DeviceUnavailable", "gpu_count", "model_device", "resolve_device", "to_device", "to_host"]


class DeviceUnavailable(ValueError):
    """A device was asked for that this machine does not have; says what there is."""


def gpu_count() -> int:
    """The CUDA devices this process can use (0 without CUDA). Like :func:`resolve_device`, never
    asked in a warm executor's parent."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(choice: str) -> torch.device:
    """The device named by ``choice``: ``auto`` (the first GPU where CUDA is, else the CPU), ``cpu``,
    ``cuda`` or ``cuda:N``. Called where training happens (a ClientApp's message process, the
    coordinator), never in a warm executor's parent: CUDA does not survive a ``fork`` after the
    parent initialised it, so only the forked children ask."""
    choice = str(choice).strip().lower()
    if choice == "cpu":
        return torch.device("cpu")
    count = gpu_count()
    if choice == "auto":
        return torch.device("cuda", 0) if count else torch.device("cpu")
    if not choice.startswith("cuda"):
        raise DeviceUnavailable(f"device must be auto, cpu, cuda or cuda:N, got {choice!r}")
    try:
        device = torch.device(choice)
    except RuntimeError as err:
        raise DeviceUnavailable(f"device {choice!r}: {err}") from None
    index = device.index or 0
    if index >= count:
        raise DeviceUnavailable(f"device {choice!r}, but this machine has {count} CUDA device(s); use auto or cpu")
    return torch.device("cuda", index)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for a model with neither."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (itself when it is there already); the copy from pinned memory to a
    GPU does not block the host."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=device.type == "cuda")


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, detached: what metrics and the exporter read."""
    return tensor.detach().cpu() if tensor.device.type != "cpu" else tensor.detach()
