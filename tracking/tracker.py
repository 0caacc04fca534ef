"""The run's tracking: every sink of the ``tracking`` setting, fed the same rows and files.

A sink that raises (a tracking server that went away, a full disk) is logged once and dropped for
the rest of the run: the run and its ``metrics.jsonl`` go on. A sink that cannot open at the start
is the same: a run is not refused for a tracking server that is down, only for a library that is
not installed (:func:`fedge.tracking.check_tracking`, before the run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fedge.tracking.scalars import row_scalars
from fedge.tracking.sink import Sink
from fedge.tracking.spec import SinkSpec, check_tracking

__all__ = ["Tracker"]

log = logging.getLogger(__name__)


class Tracker:
    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks: list[Sink] = list(sinks)

    @classmethod
    def open(cls, spec: str, run_dir: Path, *, run_name: str | None = None,
             tags: dict[str, str] | None = None) -> Tracker:
        """The sinks ``spec`` names for the run in ``run_dir`` (none: a tracker that does nothing).

        ``tensorboard:DIR`` writes into ``DIR/<run name>``, so one ``tensorboard --logdir DIR``
        shows every run (and every leaf) beside the others; without DIR, ``<run dir>/tensorboard``.
        """
        name = run_name or run_dir.name
        sinks: list[Sink] = []
        for spec_ in check_tracking(spec):
            try:
                sinks.append(_open(spec_, run_dir, name, tags or {}))
            except Exception as err:
                log.warning("tracking: %s could not open (%s: %s); the run goes on without it", spec_.kind,
                            type(err).__name__, err)
        return cls(sinks)

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def start(self, params: dict[str, Any]) -> None:
        self._each("start", lambda s: s.start({k: str(v) for k, v in params.items()}))

    def row(self, row: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` row, at its round."""
        if not self.sinks:
            return
        step, scalars = int(row["round"]), row_scalars(row)
        self._each("log", lambda s: s.log(step, scalars))

    def artifacts(self, paths: Iterable[Path | None]) -> None:
        present = [p for p in paths if p is not None and p.exists()]
        self._each("artifacts", lambda s: s.artifacts(present))

    def close(self, finished: bool = True) -> None:
        self._each("close", lambda s: s.close(finished))
        self.sinks = []

    def _each(self, what: str, call: Callable[[Sink], None]) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as err:
                log.warning("tracking: %s failed in %s (%s: %s); dropped for the rest of the run", sink.name,
                            what, type(err).__name__, err)
                self.sinks.remove(sink)


def _open(spec: SinkSpec, run_dir: Path, name: str, tags: dict[str, str]) -> Sink:
    if spec.kind == "tensorboard":
        from fedge.tracking.tensorboard_sink import TensorBoardSink

        return TensorBoardSink(Path(spec.target) / name if spec.target else run_dir / "tensorboard")
    from fedge.tracking.mlflow_sink import MlflowSink, default_uri

    return MlflowSink(spec.target or default_uri(run_dir), run_dir, name, tags)
