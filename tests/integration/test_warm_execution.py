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


def test_a_second_app_on_the_same_warm_device_runs_its_own_code_in_a_fresh_process_per_message(
        tmp_path: Path, assert_no_leftovers) -> None:
    home = tmp_path / "flwr-home"
    apps = {marker: write_marker_app(tmp_path / marker, marker) for marker in ("A", "B")}
    with ProcessGroup(tmp_path / "logs", env=flower_environment(home), also_match={"FLWR_HOME": str(home)}) as group:
        flower = FlowerLaunch(group, home, isolation="warm")
        flower.start_superlink(cwd=tmp_path)
        flower.start_supernode(0, {}, cwd=tmp_path)
        assert flower.start_warm_executor(cwd=tmp_path, partitions=False) is not None
        for marker, app in apps.items():
            _run(flower, app, {"out": str(tmp_path / f"{marker}.json"), "messages": 2}, tmp_path)
        assert flower.warm_executor is not None and flower.warm_executor.alive()
    replies = {marker: json.loads((tmp_path / f"{marker}.json").read_text()) for marker in apps}
    for marker, rounds in replies.items():
        assert [len(r) for r in rounds] == [1, 1], rounds
        # its own code (same package name `markerapp`, other FAB), and a fresh process each time:
        # the module global has counted exactly one message
        assert all(reply["marker"] == marker and reply["handled"] == 1 for r in rounds for reply in r), rounds
    pids = {reply["pid"] for rounds in replies.values() for r in rounds for reply in r}
    assert len(pids) == 4
    # every one of them was a child the warm process forked (its ledger, from wait4)
    children = {e["pid"] for e in _ledger(flower) if e["event"] == "message"}
    assert pids <= children and all(e["ended"] == "exit status 0" for e in _ledger(flower) if e["event"] == "message")
    # the supernode ran no flwr-clientapp process of its own
    assert "flwr-clientapp" not in (tmp_path / "logs" / "supernode-0.log").read_text()
    assert_no_leftovers(home)


def test_a_message_whose_process_is_killed_does_not_take_down_the_warm_device(tmp_path: Path,
                                                                            assert_no_leftovers) -> None:
    home = tmp_path / "flwr-home"
    app = write_marker_app(tmp_path / "app", "C")
    with ProcessGroup(tmp_path / "logs", env=flower_environment(home), also_match={"FLWR_HOME": str(home)}) as group:
        flower = FlowerLaunch(group, home, isolation="warm")
        flower.start_superlink(cwd=tmp_path)
        flower.start_supernode(0, {}, cwd=tmp_path)
        flower.start_warm_executor(cwd=tmp_path, partitions=False)
        started = time.monotonic()
        _run(flower, app, {"out": str(tmp_path / "out.json"), "messages": 2, "crash": 1}, tmp_path)
        took = time.monotonic() - started
        assert flower.warm_executor is not None and flower.warm_executor.alive()
    killed, after = json.loads((tmp_path / "out.json").read_text())
    assert killed == [None]  # the killed message: Flower's "ClientApp crashed" error reply
    assert len(after) == 1 and after[0]["marker"] == "C" and after[0]["handled"] == 1
    ended = [e["ended"] for e in _ledger(flower) if e["event"] == "message"]
    assert ended == ["signal 9", "exit status 0"], ended
    print(f"killed message answered and the next one run in {took:.0f} s")
    assert_no_leftovers(home)
