"""Integration tests start real Flower processes; these helpers prove none of them outlive a test."""

from __future__ import annotations

from pathlib import Path

import pytest


def processes_with_env(key: str, value: str) -> list[int]:
    """PIDs whose environment has ``key=value`` (every process a launch starts inherits FLWR_HOME)."""
    needle = f"{key}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


@pytest.fixture
def assert_no_leftovers():
    """Call with a run's FLWR_HOME after the launch: fails if any process of that run survives."""

    def check(flwr_home: Path) -> None:
        left = processes_with_env("FLWR_HOME", str(flwr_home.resolve()))
        assert not left, f"processes left running: {left}"

    return check
