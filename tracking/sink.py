"""What a tracking sink does: the interface every writer implements (TensorBoard, MLflow)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

__all__ = ["Sink"]


class Sink(Protocol):
    """One place a run's figures go. Called from the coordinator's process, one call at a time."""

    name: str

    def start(self, params: dict[str, str]) -> None:
        """The run's settings, once per process start (a resumed run logs them again: same values)."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """One step's figures (a ``metrics.jsonl`` row through :func:`fedge.tracking.row_scalars`)."""

    def artifacts(self, paths: list[Path]) -> None:
        """The run's final files (model, plot, bundle directory, summary); a sink without files ignores them."""

    def close(self, finished: bool) -> None:
        """Flush and let go; ``finished`` is false for a run stopped to be resumed later."""
