"""Device-side tests build Flower messages the way a ClientApp's process does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _task_identity() -> Iterator[None]:
    """Flower builds a ``Message`` inside a task: its runtime sets the process's task identity first.

    Set here for every device test (and put back after), so that a test does not pass or fail by
    which other test ran before it in the same worker.
    """
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved
