"""Fedge tasks: models, data (offline, embedded default: scikit-learn digits) and partitioning."""

from fedge.tasks.base import Task, TensorData
from fedge.tasks.evaluation import evaluate
from fedge.tasks.parameters import flatten_state, numel_of, tensor_sizes, unflatten_state
from fedge.tasks.registry import available_tasks, make_task, register_task

__all__ = [
    "Task",
    "TensorData",
    "available_tasks",
    "evaluate",
    "flatten_state",
    "make_task",
    "numel_of",
    "register_task",
    "tensor_sizes",
    "unflatten_state",
]
