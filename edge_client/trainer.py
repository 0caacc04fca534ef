"""Local training on a device's private data: SGD with an optional FedProx proximal term.

FedProx (Li et al., MLSys 2020, https://arxiv.org/abs/1812.06127) adds ``(mu/2)|w - w_global|^2`` to
the local loss so that clients with skewed data do not drift far from the global model; ``mu = 0`` is
plain FedAvg local SGD.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.sgd import sgd as functional_sgd
from torch.utils.data import Dataset

from fedge.aggregation.scaffold import corrected_step
from fedge.compression import derive_seed
from fedge.edge_client.resources import timed
from fedge.tasks import Task, TensorData, batches
from fedge.tasks.device import model_device, to_device


__all__ = ["LocalTrainResult", "correction_pairs", "train_local"]


@dataclass(frozen=True)
class LocalTrainResult:
    loss: float  # mean training loss over all steps (task loss only, without the proximal term)
    steps: int
    examples: int  # samples in the partition (the FedAvg weight)
    seconds: float = 0.0  # wall time of local training (optimizer set-up included), for round budgets


@torch.no_grad()
def _sgd_step(params: list[torch.Tensor], momentum_buffers: list[torch.Tensor | None], *, lr: float,
              momentum: float, weight_decay: float) -> None:
    """One step of torch's own SGD through its functional form (``torch.optim.sgd.sgd``, what
    ``torch.optim.SGD.step`` calls), with the momentum buffers kept here.

    Why not ``torch.optim.SGD``: constructing any ``torch.optim.Optimizer`` imports ``torch._dynamo``
    (its methods are wrapped in ``torch._disable_dynamo``, which imports it on first call), ~1.9 s of
    CPU. Flower starts a fresh ClientApp process for every message, so that import was paid on every
    message; py-spy on a 10-SuperNode round put it at 18% of a ClientApp process."""
    with_grad = [(i, p) for i, p in enumerate(params) if p.grad is not None]
    buffers = [momentum_buffers[i] for i, _ in with_grad]
    functional_sgd([p for _, p in with_grad], [p.grad for _, p in with_grad], buffers,
                   weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=0.0, nesterov=False,
                   maximize=False)
    for (i, _), buf in zip(with_grad, buffers):
        momentum_buffers[i] = buf


@timed("train")
def train_local(
    model: nn.Module,
    data: Dataset,
    task: Task,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    prox_mu: float = 0.0,
    generator: torch.Generator | None = None,
    correction: dict[str, torch.Tensor] | None = None,
) -> LocalTrainResult:
    """Train ``model`` in place for ``epochs`` passes over ``data`` in shuffled mini-batches,
    minimising the task's loss. With a ``generator`` everything random in training comes from it:
    the shuffles, and (under ``torch.random.fork_rng``) the global stream dropout and other layers
    draw from, seeded from the generator's own seed. A simulation runs many clients in one process,
    so without that a client's dropout masks would depend on which clients ran there before it.
    ``correction`` (SCAFFOLD's ``c - c_i``, by parameter name) moves each parameter by ``-lr *
    correction`` after every optimizer step (``fedge.aggregation.scaffold.corrected_step``)."""
    if len(data) == 0:  # type: ignore[arg-type]
        raise ValueError("this client's partition is empty")
    if generator is None:
        return _train(model, data, task, epochs=epochs, lr=lr, batch_size=batch_size, momentum=momentum,
                      weight_decay=weight_decay, prox_mu=prox_mu, generator=None, correction=correction)
    device = model_device(model)
    with torch.random.fork_rng(devices=_cuda_index(device)):
        torch.manual_seed(derive_seed(generator.initial_seed(), purpose="layers"))
        return _train(model, data, task, epochs=epochs, lr=lr, batch_size=batch_size, momentum=momentum,
                      weight_decay=weight_decay, prox_mu=prox_mu, generator=generator, correction=correction)


def _cuda_index(device: torch.device) -> list[int]:
    """The CUDA device whose generator ``fork_rng`` restores (none for the CPU: its stream always is)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def correction_pairs(model: nn.Module, correction: dict[str, torch.Tensor] | None
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, its correction on the parameter's device) pairs; a name or shape that does not
    match the model is a caller's error."""
    if not correction:
        return []
    named = dict(model.named_parameters())
    unknown = sorted(set(correction) - set(named))
    if unknown:
        raise ValueError(f"corrections for parameters the model does not have: {unknown}")
    pairs = []
    for name, c in correction.items():
        p = named[name]
        if c.shape != p.shape:
            raise ValueError(f"correction for {name} has shape {tuple(c.shape)}, the parameter {tuple(p.shape)}")
        pairs.append((p, c.to(device=p.device, dtype=p.dtype)))
    return pairs


def _train(model: nn.Module, data: Dataset, task: Task, *, epochs: int, lr: float, batch_size: int,
           momentum: float, weight_decay: float, prox_mu: float,
           generator: torch.Generator | None, correction: dict[str, torch.Tensor] | None = None) -> LocalTrainResult:
    started = time.perf_counter()
    anchor = [p.detach().clone() for p in model.parameters()] if prox_mu > 0 else None
    params = [p for p in model.parameters() if p.requires_grad]
    momentum_buffers: list[torch.Tensor | None] = [None] * len(params)
    corrected = correction_pairs(model, correction)
    model.train()
    device = model_device(model)  # the batches go where the model is (fedge.tasks.device)
    if isinstance(data, TensorData):  # on a GPU the partition goes there once
        data = data.to(device)
    # Summed in float64 where the loss is, read once: a .item() per step would wait for a GPU every
    # step; float64 adds the float32 losses exactly as Python floats did, bit for bit.
    total: torch.Tensor | None = None
    steps = 0
    for _ in range(epochs):
        for x, y in batches(data, batch_size, shuffle=True, generator=generator):
            loss = task.loss(model(to_device(x, device)), to_device(y, device))
            objective = loss
            if anchor is not None:
                drift = sum((p - a).pow(2).sum() for p, a in zip(model.parameters(), anchor))
                objective = loss + 0.5 * prox_mu * drift
            for p in params:
                p.grad = None
            objective.backward()
            _sgd_step(params, momentum_buffers, lr=lr, momentum=momentum, weight_decay=weight_decay)
            if corrected:
                with torch.no_grad():
                    for p, c in corrected:
                        corrected_step(p, c, lr)
            term = loss.detach().double()
            total = term if total is None else total + term
            steps += 1
    total_loss = 0.0 if total is None else float(total)
    if not math.isfinite(total_loss):
        raise FloatingPointError("local training diverged (non-finite loss); lower the learning rate")
    return LocalTrainResult(loss=total_loss / max(steps, 1), steps=steps, examples=len(data),  # type: ignore[arg-type]
                            seconds=time.perf_counter() - started)
