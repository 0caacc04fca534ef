"""How ``fedge serve`` decides that its run is still going. ``flwr run --stream`` was seen exiting 0 in
the middle of a run (10 SuperNodes on 2 cores) while the ServerApp went on under the SuperLink: the
daemon must then keep supervising through the SuperLink's own run status, and only call the run over
when Flower says it is finished. The real processes are exercised in tests/integration/test_serve.py;
here the two inputs (the ``flwr run`` process and Flower's status) are set by hand."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from server.serve import Daemon
from server.service_config import load_service_config


@dataclass
class _Runner:
    running: bool
    code: int | None = None

    def alive(self) -> bool:
        return self.running

    @property
    def popen(self):  # what Daemon reads: .returncode
        return self

    @property
    def returncode(self) -> int | None:
        return self.code


@pytest.fixture
def daemon(tmp_path: Path) -> Daemon:
    path = tmp_path / "fedge.toml"
    path.write_text('[service]\naddress = "127.0.0.1:9093"\nstate-dir = "state"\n\n[run]\nrounds = 2\n')
    return Daemon(load_service_config(path))


def test_the_run_is_alive_while_flwr_run_streams(daemon: Daemon) -> None:
    daemon._runner = _Runner(running=True)
    daemon._flower_run_status = lambda: pytest.fail("no need to ask the SuperLink")  # type: ignore[method-assign]
    assert daemon._run_alive()


def test_a_stream_that_ends_mid_run_hands_over_to_flowers_run_status(daemon: Daemon, caplog) -> None:
    answers = iter([("running", "N/A"), ("finished:failed", "the ServerApp exited")])
    daemon._flower_run_status = lambda: next(answers)  # type: ignore[method-assign]
    daemon._runner = _Runner(running=False, code=0)
    daemon._run_id = 42
    with caplog.at_level("WARNING", logger="fedge.serve"):
        assert daemon._run_alive()  # Flower says running: keep supervising
    assert daemon._detached and "log stream ended" in caplog.text
    assert daemon._run_alive()  # within 5 s the last answer stands (no flwr ls per loop turn)
    daemon._status_checked_at = -1e9
    assert not daemon._run_alive()  # Flower says finished: the run is over
    assert daemon.health()["run"] is False


def test_without_a_run_id_an_ended_stream_ends_the_run(daemon: Daemon) -> None:
    daemon._runner = _Runner(running=False, code=1)
    daemon._flower_run_status = lambda: pytest.fail("no run to ask about")  # type: ignore[method-assign]
    assert not daemon._run_alive()
