"""The device builds its model once per message: the layout, the start model (full or lattice), the
training and the codec's layout all use the one model the handler built."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

from fedge.edge_client import local
from tests.server.in_process_grid import InProcessGrid
from tests.server.test_engine import _engine, _start


class _CountingTask:
    """The task, with every model it builds counted."""

    def __init__(self, task: Any, counter: dict[str, int]) -> None:
        self._task, self._counter = task, counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def build_model(self) -> Any:
        self._counter["builds"] += 1
        return self._task.build_model()


@pytest.mark.parametrize(("algorithm", "downlink"), [("fedavg", "none"), ("fedavg", "lattice:ratio=0.05"),
                                                     ("easgd", "none")])
def test_each_train_message_builds_one_model(tmp_path, algorithm: str, downlink: str) -> None:
    engine = _engine(tmp_path, rounds=3, clients_per_round=3, algorithm=algorithm, downlink_codec=downlink)
    counter = {"builds": 0}
    task_of = local.task_of
    with mock.patch.object(local, "task_of", lambda config: _CountingTask(task_of(config), counter)):
        rows = engine.run(InProcessGrid(3), _start(engine)).rows
    messages = sum(row.clients_used for row in rows)
    assert messages == 9
    # a lattice device rebuilds the seeded base once, the first time, and keeps it
    first_messages = 3 if downlink.startswith("lattice") else 0
    assert counter["builds"] == messages + first_messages
