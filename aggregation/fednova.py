"""FedNova's normalisation (Wang, Liu, Liang, Joshi and Poor, "Tackling the Objective Inconsistency
Problem in Heterogeneous Federated Optimization", NeurIPS 2020, https://arxiv.org/abs/2007.07481).

A device that takes more local steps moves further, so plain FedAvg drifts toward the objective of
the devices that train longest. FedNova divides each device's change by the norm of its local
step weights, ``a_i``, averages those normalised directions with the data weights ``p_i``, and
steps by the effective number of steps ``tau_eff = sum_i p_i a_i``:

    x <- x + tau_eff * sum_i p_i (x_i - x) / a_i

For local SGD with momentum ``rho`` (the heavy-ball buffer restarted each round), the paper's
Section 4 and NIID-Bench's implementation give ``a_i = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) /
(1 - rho)``, which is ``tau_i`` for plain SGD (``rho = 0``): FedAvg is FedNova with equal steps.
"""

from __future__ import annotations

import math

__all__ = ["MAX_STEPS", "FedNovaError", "step_norm"]

#: more local steps than this in one round is a corrupt or hostile report, not a device's work
MAX_STEPS = 10_000_000


class FedNovaError(ValueError):
    """A device's step count or the momentum cannot be normalised by."""


def step_norm(steps: float, momentum: float = 0.0) -> float:
    """``a_i``: the L1 norm of the weights ``steps`` local (momentum) SGD steps put on their gradients."""
    if isinstance(steps, bool) or not isinstance(steps, (int, float)) or not math.isfinite(steps) \
            or steps != int(steps) or not 1 <= steps <= MAX_STEPS:
        raise FedNovaError(f"local steps must be a whole number in 1..{MAX_STEPS}, got {steps!r}")
    if not (isinstance(momentum, (int, float)) and 0.0 <= momentum < 1.0):
        raise FedNovaError(f"momentum must be in [0, 1), got {momentum!r}")
    tau, rho = int(steps), float(momentum)
    if rho == 0.0:
        return float(tau)
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)
