"""Pruning before export: global unstructured magnitude pruning and structured channel pruning.

Unstructured (``unstructured:sparsity=0.8``) zeroes the smallest weights across all conv/linear
layers at once (``torch.nn.utils.prune.global_unstructured``). The file stays the same size and
runs no faster, but the zeros compress (zstd) — what matters for a download. Structured
(``channels:fraction=0.5``) removes whole output channels/neurons with the smallest L1 norm and
rebuilds the layers smaller, so the model is really smaller and faster. Both are followed by a
short fine-tune on the task's training data; the masks of unstructured pruning are folded in with
``prune.remove`` before export. The two compose: ``channels:fraction=0.5+unstructured:sparsity=0.8``.

Structured pruning rewires consecutive layers, so it supports chain models: the leaf modules in
registration order must compute the same function as the model (checked on an example input).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import prune

from fedge.compression.spec import parse_spec
from torch.utils.data import Dataset

from fedge.tasks.base import Task, as_tensor_data
from fedge.tasks.evaluation import batches

__all__ = ["PruneResult", "PruningError", "apply_pruning", "fine_tune", "parse_pruning", "sparsity"]

log = logging.getLogger(__name__)

_PASS_THROUGH = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU,
                 nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Dropout, nn.Identity)


class PruningError(ValueError):
    """A pruning spec is invalid or the model cannot be pruned that way."""


@dataclass(frozen=True)
class PruneStep:
    kind: str  # "unstructured" | "channels"
    amount: float


def parse_pruning(spec: str) -> list[PruneStep]:
    """``""``/``none`` → no pruning; ``unstructured:sparsity=S``; ``channels:fraction=F``; joined by ``+``."""
    if spec.strip() in ("", "none"):
        return []
    steps = []
    for part in spec.split("+"):
        name, params = parse_spec(part)
        key = {"unstructured": "sparsity", "channels": "fraction"}.get(name)
        if key is None:
            raise PruningError(f"unknown pruning {name!r}: use unstructured:sparsity=S or channels:fraction=F")
        if set(params) - {key}:
            raise PruningError(f"{name} takes only {key}=, got {sorted(params)}")
        try:
            amount = float(params.get(key, "nan"))
        except ValueError:
            raise PruningError(f"{name}: {key} must be a number") from None
        if not 0.0 < amount < 1.0:
            raise PruningError(f"{name}: {key} must be in (0, 1), got {params.get(key)}")
        steps.append(PruneStep(name, amount))
    if [s.kind for s in steps].count("channels") > 1 or [s.kind for s in steps].count("unstructured") > 1:
        raise PruningError("give each kind of pruning at most once")
    # Channels first: removing channels after zeroing weights would rank channels by masked norms.
    return sorted(steps, key=lambda s: s.kind != "channels")


def _prunable(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def sparsity(model: nn.Module) -> float:
    """Fraction of exactly-zero weights over all conv/linear weight tensors."""
    weights = [m.weight for m in _prunable(model)]
    total = sum(w.numel() for w in weights)
    return sum(int((w == 0).sum()) for w in weights) / total if total else 0.0


def _leaves(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if not list(m.children())]


def _check_chain(model: nn.Module, example: torch.Tensor) -> list[nn.Module]:
    leaves = _leaves(model)
    with torch.no_grad():
        if not torch.allclose(nn.Sequential(*leaves)(example), model(example), atol=1e-5):
            raise PruningError("channel pruning needs a chain model: its leaf modules, in order, must be the model")
    return leaves


def _prune_channels(model: nn.Module, fraction: float, example: torch.Tensor) -> None:
    leaves = _check_chain(model.eval(), example)
    layers = [i for i, m in enumerate(leaves) if isinstance(m, (nn.Conv2d, nn.Linear))]
    for position, index in enumerate(layers[:-1]):  # never the output layer: it defines the classes
        layer, following = leaves[index], leaves[layers[position + 1]]
        between = leaves[index + 1 : layers[position + 1]]
        if any(not isinstance(m, (*_PASS_THROUGH, nn.Flatten, nn.BatchNorm2d, nn.BatchNorm1d)) for m in between):
            raise PruningError(f"cannot prune across {[type(m).__name__ for m in between]}")
        if isinstance(layer, nn.Conv2d) and layer.groups != 1:
            raise PruningError("grouped convolutions are not supported by channel pruning")
        out_channels = layer.weight.shape[0]
        keep_count = max(1, round(out_channels * (1.0 - fraction)))
        norms = layer.weight.detach().abs().reshape(out_channels, -1).sum(1)
        keep = torch.sort(torch.topk(norms, keep_count).indices).values
        layer.weight = nn.Parameter(layer.weight.detach()[keep].clone())
        if layer.bias is not None:
            layer.bias = nn.Parameter(layer.bias.detach()[keep].clone())
        if isinstance(layer, nn.Conv2d):
            layer.out_channels = keep_count
        else:
            layer.out_features = keep_count
        for module in between:
            if isinstance(module, (nn.BatchNorm2d, nn.BatchNorm1d)):
                module.weight = nn.Parameter(module.weight.detach()[keep].clone())
                module.bias = nn.Parameter(module.bias.detach()[keep].clone())
                module.running_mean = module.running_mean[keep].clone()
                module.running_var = module.running_var[keep].clone()
                module.num_features = keep_count
        columns = keep
        if any(isinstance(m, nn.Flatten) for m in between):  # conv channels -> linear features
            in_features = following.weight.shape[1]
            per_channel = in_features // out_channels
            columns = (keep[:, None] * per_channel + torch.arange(per_channel)[None, :]).reshape(-1)
        following.weight = nn.Parameter(following.weight.detach()[:, columns].clone())
        if isinstance(following, nn.Conv2d):
            following.in_channels = keep_count
        else:
            following.in_features = int(columns.numel())
    with torch.no_grad():
        model(example)  # shapes still line up


def fine_tune(model: nn.Module, data: Dataset, task: Task, *, epochs: int, lr: float = 0.02,
              batch_size: int = 32, seed: int = 0) -> None:
    """A short SGD fine-tune (masks of unstructured pruning stay applied through their hooks)."""
    if epochs <= 0:
        return
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    for _ in range(epochs):
        for x, y in batches(data, batch_size, shuffle=True, generator=generator):
            loss = task.loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()


@dataclass
class PruneResult:
    parameters_before: int
    parameters_after: int
    sparsity: float  # zero weights / all conv+linear weights, after pruning


def apply_pruning(model: nn.Module, spec: str, data: Dataset, task: Task, *, fine_tune_epochs: int = 3,
                  seed: int = 0) -> PruneResult:
    """Prune ``model`` in place as ``spec`` says, fine-tuning after each step; masks folded in."""
    steps = parse_pruning(spec)
    before = sum(p.numel() for p in model.parameters())
    for step in steps:
        if step.kind == "channels":
            _prune_channels(model, step.amount, as_tensor_data(data, 8).x)
        else:
            targets = [(m, "weight") for m in _prunable(model)]
            prune.global_unstructured(targets, pruning_method=prune.L1Unstructured, amount=step.amount)
        fine_tune(model, data, task, epochs=fine_tune_epochs, seed=seed)
        if step.kind == "unstructured":
            for module, name in [(m, "weight") for m in _prunable(model)]:
                prune.remove(module, name)  # fold the mask: a plain weight tensor with zeros
    result = PruneResult(before, sum(p.numel() for p in model.parameters()), sparsity(model))
    if steps:
        log.info("pruned %s: %d -> %d parameters, sparsity %.1f%%", spec, result.parameters_before,
                 result.parameters_after, 100 * result.sparsity)
    return result
