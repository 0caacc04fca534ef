"""Fedge tasks: the public Task API (``docs/extending.md``), the built-in tasks (embedded default:
scikit-learn digits) and partitioning."""

from fedge.tasks.base import Task, TensorData, as_tensor_data
from fedge.tasks.evaluation import batches, chance_accuracy, evaluate, predict
from fedge.tasks.initial import seeded_initial_params
from fedge.tasks.parameters import flatten_state, numel_of, tensor_sizes, unflatten_state
from fedge.tasks.registry import TaskNotFoundError, available_tasks, make_task, register_task

__all__ = [
    "seeded_initial_params",
    "Task",
    "TaskNotFoundError",
    "TensorData",
    "as_tensor_data",
    "available_tasks",
    "batches",
    "chance_accuracy",
    "evaluate",
    "flatten_state",
    "make_task",
    "numel_of",
    "predict",
    "register_task",
    "tensor_sizes",
    "unflatten_state",
]
