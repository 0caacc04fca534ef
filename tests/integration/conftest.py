"""Integration tests start real Flower processes; this fixture proves none of them outlives a test."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.processes import processes_with_env


@pytest.fixture
def assert_no_leftovers():
    """Call with a run's FLWR_HOME after the launch: fails if any process of that run survives.

    Every process a launch starts (and every descendant) inherits that FLWR_HOME in its environment.
    """

    def check(flwr_home: Path) -> None:
        left = processes_with_env("FLWR_HOME", str(flwr_home.resolve()))
        assert not left, f"processes left running: {left}"

    return check
