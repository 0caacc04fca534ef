"""The seeded initial model: the same flat vector wherever the task and seed are the same.

The coordinator starts a run from it, and a device rebuilds it as the base of the compressed
downlink's lattice (``fedge.aggregation.broadcast``) instead of downloading it; the device checks
what it built against the coordinator's digest, since another torch build may draw differently.
"""

from __future__ import annotations

import torch

from fedge.compression import derive_seed
from fedge.tasks.base import Task
from fedge.tasks.parameters import flatten_state

__all__ = ["seeded_initial_model", "seeded_initial_params"]


def seeded_initial_model(task: Task, seed: int) -> torch.nn.Module:
    """The task's model as :func:`seeded_initial_params` draws it (for a caller that needs its layout too)."""
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(seed, purpose="init"))
        return task.build_model()


def seeded_initial_params(task: Task, seed: int) -> torch.Tensor:
    """The task's random initialisation from its own stream (``derive_seed(seed, purpose="init")``)
    under ``fork_rng``, leaving the process's global torch RNG as it was."""
    return flatten_state(seeded_initial_model(task, seed).state_dict())
