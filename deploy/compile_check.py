"""Check that ``torch.compile`` computes a model's gradients as eager PyTorch does, before training.

Why: compiler bugs that return wrong gradients without an error are a known class in Inductor
(pytorch/pytorch#182012, #180164, #185509). One hit this project: on torch 2.13's CPU backend the
digits CNN's convolution weights got all-zero gradients when compiled, so ``--compile`` trained
only the linear layers (digits, 6 epochs: 90.8% against 96.4% eager, with nothing logged). A run
that would train on such gradients is refused at its start, with what to do instead.

The check compiles a copy of the model with the run's mode and compares one batch's gradients
with eager ones on another copy, so the run's own model, its DDP reducer and any communication
hook state are untouched. The tolerance is loose enough for bf16 autocast's rounding and tight
enough for gradients that are zero, of the wrong sign or of another layer.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["COMPILE_TOLERANCE", "compiled_gradient_error"]

log = logging.getLogger(__name__)

#: the largest relative L2 error of any parameter's gradient that a compiled model may show
COMPILE_TOLERANCE = 0.05


def _gradients(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
               loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               autocast: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=autocast):
        value = loss(forward(x), y)
    value.backward()
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}


def compiled_gradient_error(model: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                            x: torch.Tensor, y: torch.Tensor, *, mode: str = "default",
                            autocast: bool = False) -> tuple[str, float] | None:
    """The parameter whose compiled gradient is furthest from its eager one, and that relative L2
    error, when it exceeds :data:`COMPILE_TOLERANCE` (None: the compiled gradients agree)."""
    eager_model = copy.deepcopy(model).train()
    compiled_model = copy.deepcopy(model).train()
    eager = _gradients(eager_model, eager_model, loss, x, y, autocast)
    compiled = _gradients(compiled_model, torch.compile(compiled_model, mode=mode), loss, x, y, autocast)
    worst, error = "", 0.0
    for name, reference in eager.items():
        got = compiled.get(name)
        scale = float(reference.norm())
        if got is None:
            here = 1.0  # no gradient at all where eager has one
        elif scale == 0.0:
            here = float(got.norm())
        else:
            here = float((got - reference).norm()) / scale
        if not here <= error:  # NaN counts as worst
            worst, error = name, here
    log.info("compiled gradients: largest relative error %.2e (%s)", error, worst or "-")
    return (worst, error) if not error <= COMPILE_TOLERANCE else None
