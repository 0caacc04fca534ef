"""Device-side tests build Flower messages the way a ClientApp's process does."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _task_identity(flower_task_identity: None) -> None:
    """Every test here builds Flower messages as a task would (``tests/conftest.py``)."""
