"""Task registry: ``digits`` (embedded default), ``synthetic:hidden=1024,...``, ``fashion`` (Debian package)."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from fedge.compression.spec import build_from_spec
from fedge.tasks.base import Task
from fedge.tasks.digits import DigitsTask
from fedge.tasks.fashion_mnist import FashionMNISTTask
from fedge.tasks.synthetic import SyntheticTask

__all__ = ["available_tasks", "make_task", "register_task"]

_REGISTRY: dict[str, Callable[..., Task]] = {
    "digits": DigitsTask, "synthetic": SyntheticTask, "fashion": FashionMNISTTask,
}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    _REGISTRY[name] = factory


def available_tasks() -> list[str]:
    return sorted(_REGISTRY)


@lru_cache(maxsize=8)
def make_task(spec: str) -> Task:
    """The task a spec names (cached: a process building the same task twice shares its data)."""
    task = build_from_spec(spec, _REGISTRY, family="task")
    assert isinstance(task, Task)
    return task
