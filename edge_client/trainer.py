"""Local training on a device's private data: SGD with an optional FedProx proximal term.

FedProx (Li et al., MLSys 2020, https://arxiv.org/abs/1812.06127) adds ``(mu/2)|w - w_global|^2`` to
the local loss so that clients with skewed data do not drift far from the global model; ``mu = 0`` is
plain FedAvg local SGD.
"""

from __future__ import annotations

import time

from dataclasses import dataclass

import torch
from torch import nn

from tasks import TensorData

__all__ = ["LocalTrainResult", "train_local"]


@dataclass(frozen=True)
class LocalTrainResult:
    loss: float  # mean training loss over all steps (task loss only, without the proximal term)
    steps: int
    examples: int  # samples in the partition (the FedAvg weight)
    seconds: float = 0.0  # wall time of local training (optimizer set-up included), for round budgets


def train_local(
    model: nn.Module,
    data: TensorData,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    prox_mu: float = 0.0,
    generator: torch.Generator | None = None,
) -> LocalTrainResult:
    """Train ``model`` in place for ``epochs`` passes over ``data`` in shuffled mini-batches."""
    if len(data) == 0:
        raise ValueError("this client's partition is empty")
    started = time.perf_counter()
    anchor = [p.detach().clone() for p in model.parameters()] if prox_mu > 0 else None
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay
    )
    model.train()
    total_loss, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=generator)
        for start in range(0, len(data), batch_size):
            index = order[start : start + batch_size]
            loss = nn.functional.cross_entropy(model(data.x[index]), data.y[index])
            objective = loss
            if anchor is not None:
                drift = sum((p - a).pow(2).sum() for p, a in zip(model.parameters(), anchor))
                objective = loss + 0.5 * prox_mu * drift
            optimizer.zero_grad(set_to_none=True)
            objective.backward()
            optimizer.step()
            total_loss += loss.item()
            steps += 1
    if not torch.isfinite(torch.tensor(total_loss)):
        raise FloatingPointError("local training diverged (non-finite loss); lower the learning rate")
    return LocalTrainResult(loss=total_loss / max(steps, 1), steps=steps, examples=len(data),
                            seconds=time.perf_counter() - started)
