"""What a task spec names, read without building the task: which of the three forms it is
(``fedge.tasks.registry``), and which module an import path needs in every process.

Kept apart from the registry, which imports the built-in tasks (torch): ``fedge demo``'s launcher
stages the app bundle from a spec before any process that trains starts, and a CLI that has not
imported torch should not import it for a string's shape.
"""

from __future__ import annotations

from fedge.compression.errors import SpecError

__all__ = ["TaskNotFoundError", "import_path_of", "task_module"]


class TaskNotFoundError(SpecError):
    """A task spec names nothing that can be built; the message says what was tried."""


def import_path_of(spec: str) -> tuple[str, str, str] | None:
    """``(module, attribute, parameters)`` if ``spec`` is an import path (``module:Attr[:k=v,...]``),
    else ``None``. A built-in or plugin spec has ``key=value`` pairs after its only colon; an import
    path has an attribute name there."""
    head, colon, rest = spec.strip().partition(":")
    if not colon:
        return None
    attribute, _, params = rest.partition(":")
    if "=" in attribute or "," in attribute:
        return None
    if not attribute.isidentifier() or not all(part.isidentifier() for part in head.split(".")):
        raise TaskNotFoundError(f"task {spec!r}: an import path is 'package.module:Class[:key=value,...]'")
    return head, attribute, params


def task_module(spec: str) -> str | None:
    """The top-level module an import-path spec needs in every process (``None`` for other forms):
    what ``fedge demo`` puts in the app bundle beside Fedge."""
    path = import_path_of(spec)
    return path[0].split(".")[0] if path else None
