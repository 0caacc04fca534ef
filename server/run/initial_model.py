"""The run's initial model: from a model file (cloud pretraining hands off to federated fine-tuning)
or the task's seeded random initialisation."""

from __future__ import annotations

import logging

import torch

from fedge.tasks import Task, flatten_state, seeded_initial_params

__all__ = ["initial_params"]

log = logging.getLogger(__name__)


def initial_params(task: Task, seed: int, init: str = "") -> torch.Tensor:
    """The initial model as a flat vector: the model file ``init``, or the seeded random
    initialisation (``fedge.tasks.seeded_initial_params``)."""
    if not init:
        return seeded_initial_params(task, seed)
    from fedge.deploy.model_file import ModelFileError, load_model_file

    loaded = load_model_file(init)
    if loaded.task != task.spec:
        raise ModelFileError(f"{init} holds a model of task {loaded.task!r}, this run trains {task.spec!r}")
    model = task.build_model()
    model.load_state_dict(loaded.state_dict, strict=True)
    log.info("initial model from %s", init)
    return flatten_state(model.state_dict())
