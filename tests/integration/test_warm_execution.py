"""Warm execution on real processes: a SuperLink, a SuperNode with ``--isolation process`` and the
warm process (``fedge.edge_client.warm_executor``) that forks a child per message.

Runs stay isolated: a second run whose app has the same package name but other code runs its own
code on the same warm device, every message starts from a fresh process (a module global counts
one message each), and a message whose process is killed costs that message only. The Fedge app
itself runs warm in every other deployment test (warm is the default); the first test here also
checks its resource report against the warm process's exact accounting.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fedge.launcher.environment import flower_environment
from fedge.launcher.processes import ProcessGroup
from fedge.launcher.sequence import FlowerLaunch
from tests.integration.apps.marker_app import write_marker_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def _run(flower: FlowerLaunch, app: Path, config: dict[str, object], cwd: Path) -> None:
    runner = flower.submit(app, config, cwd=cwd)
    flower.follow(runner, time.monotonic() + 240)
    assert runner.popen.returncode == 0, runner.log_tail(40)
    flower.group.processes.remove(runner)  # finished: not a process that "exited early" for the next run


def _ledger(flower: FlowerLaunch) -> list[dict[str, object]]:
    return [json.loads(line) for line in flower.warm_ledger.read_text().splitlines() if line.strip()]


def test_runs_stay_apart_on_a_warm_device_and_a_killed_message_does_not_take_it_down(
        tmp_path: Path, assert_no_leftovers) -> None:
    """On one warm device: app A, then app C whose message kills its own process, then app B (same
    package name as A and C, other code)."""
    home = tmp_path / "flwr-home"
    apps = {marker: write_marker_app(tmp_path / marker, marker) for marker in ("A", "C", "B")}
    with ProcessGroup(tmp_path / "logs", env=flower_environment(home), also_match={"FLWR_HOME": str(home)}) as group:
        flower = FlowerLaunch(group, home, isolation="warm")
        flower.start_superlink(cwd=tmp_path)
        flower.start_supernode(0, {}, cwd=tmp_path)
        assert flower.start_warm_executor(cwd=tmp_path, partitions=False) is not None
        _run(flower, apps["A"], {"out": str(tmp_path / "A.json"), "messages": 2}, tmp_path)
        # the killed message gets no reply within 10 s (Flower answers it with a "ClientApp crashed"
        # error only once its task heartbeat expires, about a minute, as under subprocess isolation)
        _run(flower, apps["C"], {"out": str(tmp_path / "C.json"), "messages": 1, "crash": 1, "crash-timeout": 10},
             tmp_path)
        started = time.monotonic()
        _run(flower, apps["B"], {"out": str(tmp_path / "B.json"), "messages": 2}, tmp_path)
        after_crash = time.monotonic() - started
        assert flower.warm_executor is not None and flower.warm_executor.alive()
    assert json.loads((tmp_path / "C.json").read_text()) == [[]]
    replies = {marker: json.loads((tmp_path / f"{marker}.json").read_text()) for marker in ("A", "B")}
    for marker, rounds in replies.items():
        assert [len(r) for r in rounds] == [1, 1], rounds
        # its own code (same package name `markerapp`, other FAB), and a fresh process each time:
        # the module global has counted exactly one message
        assert all(reply["marker"] == marker and reply["handled"] == 1 for r in rounds for reply in r), rounds
    pids = {reply["pid"] for rounds in replies.values() for r in rounds for reply in r}
    assert len(pids) == 4
    # every one of them was a child the warm process forked (its ledger, from wait4); C's died by SIGKILL
    messages = [e for e in _ledger(flower) if e["event"] == "message"]
    assert pids <= {e["pid"] for e in messages}
    assert [e["ended"] for e in messages] == ["exit status 0"] * 2 + ["signal 9"] + ["exit status 0"] * 2
    # the supernode ran no flwr-clientapp process of its own
    assert "flwr-clientapp" not in (tmp_path / "logs" / "supernode-0.log").read_text()
    print(f"the run after the killed message took {after_crash:.0f} s")
    assert_no_leftovers(home)
