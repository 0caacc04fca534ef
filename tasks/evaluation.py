"""Held-out evaluation shared by the coordinator, the edge client and the cloud trainer."""

from __future__ import annotations

import torch
from torch import nn

from fedge.tasks.base import TensorData

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorData, batch_size: int = 512) -> tuple[float, float]:
    """Return ``(mean cross-entropy loss, accuracy)`` of ``model`` on ``data``."""
    if len(data) == 0:
        raise ValueError("cannot evaluate on an empty data set")
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(data), batch_size):
        x = data.x[start : start + batch_size]
        y = data.y[start : start + batch_size]
        logits = model(x)
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    model.train(was_training)
    return loss_sum / len(data), correct / len(data)
