"""Fedge tasks: the public Task API (``docs/extending.md``), the built-in tasks (embedded default:
scikit-learn digits) and partitioning.

The package's names are imported on first use (PEP 562), as ``fedge.compression``'s are: a task
builds torch models, and a process that only resolves a task's module or its cached data (``fedge
demo``'s CLI before it starts Flower's processes) should not pay torch's import for it.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: each public name and the submodule it lives in
_NAMES = {
    "Task": "base",
    "TaskNotFoundError": "registry",
    "TensorData": "base",
    "as_tensor_data": "base",
    "available_tasks": "registry",
    "batches": "evaluation",
    "chance_accuracy": "evaluation",
    "evaluate": "evaluation",
    "flatten_state": "parameters",
    "make_task": "registry",
    "numel_of": "parameters",
    "predict": "evaluation",
    "register_task": "registry",
    "seeded_initial_model": "initial",
    "seeded_initial_params": "initial",
    "tensor_sizes": "parameters",
    "unflatten_state": "parameters",
}
__all__ = [
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
    "seeded_initial_model",
    "seeded_initial_params",
    "tensor_sizes",
    "unflatten_state",
]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(import_module(f"fedge.tasks.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'fedge.tasks' has no attribute {name!r}")
