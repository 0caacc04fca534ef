"""Which task a spec names: a built-in, an installed plugin, or a class by import path.

Three forms, the same everywhere a task spec goes (``--task``, ``task = ...`` in a run config, a
model file's header, ``fedge-edge join --task``):

* a built-in: ``digits`` (embedded default), ``synthetic:hidden=1024``, ``fashion`` (Debian package);
* an installed plugin: a name registered in the ``fedge.tasks`` entry-point group of any installed
  distribution (``[project.entry-points."fedge.tasks"] housing = "my_pkg.task:HousingTask"``);
* an import path: ``module:Class`` with optional parameters after a second colon,
  ``my_app.task:HousingTask:hidden=64,depth=2``. The module must be importable in every process
  that runs the task: the app directory travels in the Flower app bundle (``fedge new``, ``fedge
  demo --app``), a device installs it, the torchrun trainer and the exporter import it from the
  current directory or the environment.

Parameters use the grammar of every other spec (``fedge.compression.spec``): ``key=value`` pairs
converted to the types of the constructor's defaults. Tasks are built once per process per spec.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Callable
from functools import lru_cache

from fedge.compression.spec import build_from_spec, parse_spec
from fedge.tasks.base import Task
from fedge.tasks.digits import DigitsTask
from fedge.tasks.fashion_mnist import FashionMNISTTask
from fedge.tasks.shakespeare import ShakespeareTask
from fedge.tasks.synthetic import SyntheticTask
from fedge.tasks.task_spec import TaskNotFoundError, import_path_of, task_module

__all__ = ["ENTRY_POINT_GROUP", "TaskNotFoundError", "available_tasks", "import_path_of", "make_task",
           "register_task", "task_module"]

#: the entry-point group installed task plugins register under
ENTRY_POINT_GROUP = "fedge.tasks"

_BUILTIN: dict[str, Callable[..., Task]] = {
    "digits": DigitsTask, "synthetic": SyntheticTask, "fashion": FashionMNISTTask, "shakespeare": ShakespeareTask,
}
#: registered by ``register_task`` in this process (a notebook, a test, a plugin module that every
#: process of a run loads)
_REGISTERED: dict[str, Callable[..., Task]] = {}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Register ``factory`` under ``name`` in this process. Flower's ServerApp and ClientApp run in
    other processes: for a run, call it from a plugin module (the ``plugins`` setting, which every
    process loads), or use an import path or an entry point."""
    _REGISTERED[name.lower()] = factory


def _plugins() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name.lower(): ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_tasks() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTERED, *_plugins()})


def _import_factory(spec: str, module_name: str, attribute: str) -> Callable[..., Task]:
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        searched = [p or "." for p in sys.path[:6]]
        raise TaskNotFoundError(
            f"task {spec!r}: cannot import module {module_name!r} ({err}); searched {searched}"
            f"{' …' if len(sys.path) > 6 else ''}. Run from the directory that holds it, install it, or "
            "use `fedge demo --app DIR` so that it travels in the app bundle"
        ) from None
    factory = getattr(module, attribute, None)
    if factory is None:
        found = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and issubclass(v, Task) and v is not Task)
        raise TaskNotFoundError(f"task {spec!r}: module {module_name!r} ({module.__file__}) has no {attribute!r}; "
                                f"Task classes there: {', '.join(found) or 'none'}")
    return factory


def _factory(spec: str) -> tuple[str, Callable[..., Task], str]:
    """(canonical head, factory, parameters) for any of the three forms."""
    path = import_path_of(spec)
    if path is not None:
        module_name, attribute, params = path
        return f"{module_name}:{attribute}", _import_factory(spec, module_name, attribute), params
    name, _ = parse_spec(spec)
    params = spec.strip().partition(":")[2]
    for table in (_BUILTIN, _REGISTERED):
        if name in table:
            return name, table[name], params
    plugin = _plugins().get(name)
    if plugin is not None:
        try:
            return name, plugin.load(), params
        except Exception as err:
            raise TaskNotFoundError(f"task plugin {name!r} ({plugin.value}, entry point group "
                                    f"{ENTRY_POINT_GROUP!r}) failed to load: {type(err).__name__}: {err}") from None
    raise TaskNotFoundError(
        f"unknown task {name!r}; available: {', '.join(available_tasks())}, or an import path "
        "'package.module:Class' (e.g. 'task:MyTask' for a task.py in the app directory)"
    )


@lru_cache(maxsize=8)
def make_task(spec: str) -> Task:
    """The task a spec names (cached: a process building the same task twice shares its data)."""
    head, factory, params = _factory(spec)
    task = build_from_spec(f"{head.replace(':', '.')}{':' + params if params else ''}",
                           {head.replace(":", ".").lower(): factory}, family="task")
    if not isinstance(task, Task):
        raise TaskNotFoundError(f"task {spec!r}: {head} built a {type(task).__name__}, not a fedge.tasks.Task")
    if import_path_of(spec) is not None or not getattr(task, "spec", ""):
        # an import-path task is rebuilt from its path in every process, whatever spec a base
        # class (a built-in task it extends) would give it
        task.spec = f"{head}:{params}" if params else head
    if not task.input_shape:
        raise TaskNotFoundError(f"task {task.spec!r} does not set input_shape (one sample's shape)")
    return task
