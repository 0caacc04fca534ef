"""A round engine on simulated time for the engine's unit tests (with ``InProcessGrid``)."""

from __future__ import annotations

from typing import Any

from fedge.server.algorithms.registry import make_algorithm
from fedge.server.engine.loop import Engine, make_context
from fedge.server.run.run_directory import RunDirectory
from fedge.server.settings import RunSettings
from fedge.tasks import make_task
from tests.server.in_process_grid import FakeClock


def build_engine(values: dict[str, Any]) -> Engine:
    """An engine for ``RunSettings(**values)``, its run directory started, its clock simulated."""
    settings = RunSettings(**values)
    run_dir = RunDirectory(settings.run_dir)
    run_dir.start(settings)
    algorithm = make_algorithm(settings.algorithm, make_context(settings, make_task(settings.task)))
    clock = FakeClock()
    return Engine(algorithm, run_dir, clock=clock, sleep=clock.sleep)
