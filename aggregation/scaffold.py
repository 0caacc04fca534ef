"""SCAFFOLD's control variates (Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, "SCAFFOLD:
Stochastic Controlled Averaging for Federated Learning", ICML 2020, https://arxiv.org/abs/1910.06378).

Under skewed data each device's local steps drift toward its own optimum. SCAFFOLD keeps a control
variate per device, ``c_i``, and one at the server, ``c`` (the mean of the ``c_i``); every local
step is corrected by ``c - c_i``, the difference between the federation's and the device's gradient
direction (Algorithm 1, line 10):

    y <- y - lr (g_i(y) + c - c_i)

After ``K`` local steps from the server model ``x`` the device updates its variate with the
paper's option II (line 12), which needs no extra gradient pass:

    c_i+ = c_i - c + (x - y) / (K lr)

and sends ``dy = y - x`` and ``dc_i = c_i+ - c_i``. The server (lines 16-17), over the sampled set
``S`` of the ``N`` devices: ``x <- x + lr_g mean_S(dy)``, ``c <- c + (1/N) sum_S dc_i``.

With local momentum (NIID-Bench's setting: SGD with momentum 0.9) the correction is applied as
NIID-Bench applies it, after each momentum step and outside the momentum buffer
(:func:`corrected_step`): the variates then estimate the momentum-amplified local direction,
exactly as its published runs did.

Pure math on flat tensors: no Flower, no devices, no wire.
"""

from __future__ import annotations

import math

import torch


__all__ = ["ScaffoldError", "control_step", "corrected_step", "device_control", "server_control"]


class ScaffoldError(ValueError):
    """Inputs the SCAFFOLD rules cannot take (mismatched lengths, no steps, a bad rate)."""


def _check(lr: float, steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ScaffoldError(f"local steps must be a whole number >= 1, got {steps!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ScaffoldError(f"the local learning rate must be > 0, got {lr!r}")


def corrected_step(param: torch.Tensor, correction: torch.Tensor, lr: float) -> None:
    """One parameter after its optimizer step: ``param -= lr * (c - c_i)`` (in place)."""
    param.add_(correction, alpha=-lr)


def device_control(control: torch.Tensor, server: torch.Tensor, delta: torch.Tensor, steps: int,
                   lr: float) -> torch.Tensor:
    """``c_i+`` by option II: ``c_i - c + (x - y) / (K lr)`` with ``delta = y - x``."""
    _check(lr, steps)
    if not control.shape == server.shape == delta.shape:
        raise ScaffoldError(f"control variates and update differ in shape: {tuple(control.shape)}, "
                            f"{tuple(server.shape)}, {tuple(delta.shape)}")
    return control - server - delta / (steps * lr)


def control_step(control: torch.Tensor, server: torch.Tensor, delta: torch.Tensor, steps: int,
                 lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c_i+, dc_i)``: the device's new variate and the change it sends."""
    new = device_control(control, server, delta, steps, lr)
    return new, new - control


def server_control(server: torch.Tensor, control_sum: torch.Tensor, population: int) -> torch.Tensor:
    """``c + (1/N) sum_S dc_i``: the server's variate stays the mean of the ``N`` devices' ones."""
    if isinstance(population, bool) or not isinstance(population, int) or population < 1:
        raise ScaffoldError(f"the population must be a whole number >= 1, got {population!r}")
    if control_sum.shape != server.shape:
        raise ScaffoldError(f"the control sum has shape {tuple(control_sum.shape)}, the server's variate "
                            f"{tuple(server.shape)}")
    return server + control_sum / population
