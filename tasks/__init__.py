"""Fedge tasks: models, data (offline, embedded default: scikit-learn digits) and partitioning."""

from tasks.base import Task, TensorData
from tasks.evaluation import evaluate
from tasks.parameters import flatten_state, numel_of, tensor_sizes, unflatten_state
from tasks.registry import available_tasks, make_task, register_task

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
