"""The process helpers every engine relies on: a per-process environment keeps the group's marker, and a
sweep by FLWR_HOME finds the SuperNodes whose homes live inside the run's."""

from __future__ import annotations

import sys
from pathlib import Path

from fedge.launcher.environment import supernode_home
from fedge.launcher.processes import MARKER, ProcessGroup, processes_with_env

_SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_own_flwr_home_per_process_is_still_found_and_stopped(tmp_path: Path) -> None:
    home = tmp_path / "flwr-home"
    group = ProcessGroup(tmp_path / "logs", env={"FLWR_HOME": str(home), "PATH": "/usr/bin:/bin"})
    try:
        link = group.start("superlink", _SLEEP)
        node = group.start("supernode-0", _SLEEP, env={"FLWR_HOME": str(supernode_home(home, 0)), MARKER: "not-the-group"})
        assert processes_with_env("FLWR_HOME", str(home)) == [link.pid]
        assert processes_with_env("FLWR_HOME", str(supernode_home(home, 0))) == [node.pid]
        assert sorted(processes_with_env("FLWR_HOME", str(home), under=True)) == sorted([link.pid, node.pid])
        # a sibling whose name merely starts the same is not inside the home
        assert processes_with_env("FLWR_HOME", str(tmp_path / "flwr-ho"), under=True) == []
        assert sorted(group.stragglers()) == sorted([link.pid, node.pid])  # the marker survived the override
    finally:
        group.stop(grace=5.0)
    assert processes_with_env("FLWR_HOME", str(home), under=True) == []


def test_simulated_clients_share_the_gpus_and_get_none_without_one() -> None:
    from fedge.server.local import gpu_share

    assert gpu_share(8, gpus=0) == 0.0
    assert gpu_share(8, gpus=1) == 0.125  # eight ClientApps at once on one GPU
    assert gpu_share(2, gpus=4) == 1.0  # never more than a whole GPU each
    assert gpu_share(0, gpus=1) == 1.0
