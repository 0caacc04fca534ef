"""Evaluation shared by the coordinator, the devices, the cloud trainer and the exporter.

One function: the task's loss and metrics of a model on a split, computed over the whole split's
outputs at once (so a metric need not be decomposable into batches). Each value is a mean over
examples, which is what lets federated evaluation combine devices' figures weighted by examples.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

from fedge.tasks.base import Task, TensorData
from fedge.tasks.device import model_device, to_device, to_host

__all__ = ["batches", "chance_accuracy", "evaluate", "predict"]


def batches(data: Dataset, batch_size: int, *, shuffle: bool = False, generator: torch.Generator | None = None,
            order: torch.Tensor | None = None, drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Mini-batches ``(x, y)`` of any map-style dataset. In-memory :class:`TensorData` is sliced
    directly (no per-item Python calls), in ``order`` when given (a sampler's indices; the cloud
    trainer's device-held batches), the last incomplete batch left out with ``drop_last``; anything
    else goes through a single-process ``DataLoader`` (worker processes would multiply on a device
    that already runs a process per message)."""
    if isinstance(data, TensorData):
        if order is None and shuffle:
            order = torch.randperm(len(data), generator=generator)
        end = len(data) if order is None else len(order)
        for start in range(0, end - end % batch_size if drop_last else end, batch_size):
            if order is None:
                yield data.x[start : start + batch_size], data.y[start : start + batch_size]
            else:
                index = order[start : start + batch_size]
                yield data.x[index], data.y[index]
        return
    sampler = RandomSampler(data, generator=generator) if shuffle else None  # type: ignore[arg-type]
    yield from DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=0)


@torch.no_grad()
def predict(model: nn.Module, data: Dataset, batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's outputs on every sample of ``data`` and the targets, in order, on the CPU (the
    batches are sent to the model's device, :mod:`fedge.tasks.device`)."""
    if len(data) == 0:  # type: ignore[arg-type]
        raise ValueError("cannot evaluate on an empty data set")
    was_training = model.training
    model.eval()
    device = model_device(model)  # batches go where the model is; outputs come back to the host
    outputs, targets = [], []
    for x, y in batches(data, batch_size):
        outputs.append(to_host(model(to_device(x, device))))
        targets.append(y)
    model.train(was_training)
    return torch.cat(outputs), torch.cat(targets)


def evaluate(model: nn.Module, data: Dataset, task: Task, batch_size: int = 512) -> dict[str, float]:
    """``{"loss": ..., **task.metrics(...)}`` of ``model`` on ``data`` (every value finite-checked
    by the caller that needs it)."""
    outputs, targets = predict(model, data, batch_size)
    with torch.no_grad():
        loss = float(task.loss(outputs, targets))
    metrics = {str(k): float(v) for k, v in task.metrics(outputs, targets).items()}
    if "loss" in metrics:
        raise ValueError(f"task {task.spec!r}: 'loss' is reported by Fedge itself; name the metric otherwise")
    return {"loss": loss, **metrics}


def chance_accuracy(task: Task, targets: torch.Tensor) -> float | None:
    """The accuracy of always answering the most common class of ``targets``: what a model that
    learned nothing scores (the cloud trainer stops at it, the exporter refuses it). None for a
    task whose metric is not accuracy, or targets that are not class labels."""
    if task.primary_metric != "accuracy" or targets.numel() == 0 or targets.is_floating_point():
        return None
    return float(torch.bincount(targets.long().reshape(-1)).max()) / targets.numel()
