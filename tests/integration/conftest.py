"""Integration tests start real Flower processes; this fixture proves none of them outlives a test."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fedge.launcher.processes import processes_with_env


def _describe(pid: int) -> str:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} state {state}: {command}"


@pytest.fixture
def assert_no_leftovers():
    """Call with a run's FLWR_HOME after the launch: fails if any process of that run survives.

    Every process a launch starts (and every descendant) inherits that FLWR_HOME in its environment.
    """

    def check(flwr_home: Path) -> None:
        # A SIGKILLed process can take a moment to exit on a loaded machine (unmapping a large Ray
        # worker): allow it a few seconds, then report what is left, with its state and command.
        deadline = time.monotonic() + 15.0
        left = processes_with_env("FLWR_HOME", str(flwr_home.resolve()), under=True)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = processes_with_env("FLWR_HOME", str(flwr_home.resolve()), under=True)
        assert not left, f"processes left running: {[_describe(pid) for pid in left]}"

    return check
