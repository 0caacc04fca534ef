"""Elastic averaging's two formulas (EASGD, Zhang, Choromanska and LeCun 2015), once for every side
that uses them: Fedge's EASGD device handler and ``fedge.edge_client.elastic_mod`` (a node's step),
Fedge's EASGD algorithm and ``fedge.coordinator.elastic_layer`` (the center's step).

A node that trained its own model x_i from where it stood sends the elastic difference
δ_i = α(x_i − x̃) against the center x̃ it received and keeps x_i − δ_i; the center moves by the
differences, x̃ ← x̃ + (β / (α m)) Σ δ_i over the m that arrived (with the paper's coupling β = nα
and all n answering, its x̃ + Σ δ_i exactly; with fewer, still β of the way to their mean).
"""

from __future__ import annotations

import torch

__all__ = ["center_step", "elastic_difference"]


def elastic_difference(trained: torch.Tensor, center: torch.Tensor,
                       alpha: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(δ = α(x − x̃), the model the node keeps x − δ, the distance ‖x − x̃‖) for a node whose own
    model trained to ``trained`` in a round whose center is ``center``."""
    apart = trained - center
    delta = alpha * apart
    return delta, trained - delta, float(apart.norm())


def center_step(total: torch.Tensor, used: int, alpha: float, beta: float) -> torch.Tensor:
    """How far the center moves: (β / (α m)) times the sum ``total`` of the m = ``used`` differences."""
    return (beta / (alpha * used)) * total
