"""How ``fedge serve`` decides that its run is still going. ``flwr run --stream`` was seen exiting 0 in
the middle of a run (10 SuperNodes on 2 cores) while the ServerApp went on under the SuperLink: the
daemon must then keep supervising through the SuperLink's own run status, and only call the run over
when Flower says it is finished. The real processes are exercised in tests/integration/test_serve.py;
here the two inputs (the ``flwr run`` process and Flower's status) are set by hand."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from fedge.server.daemon.serve import Daemon
from fedge.server.daemon.service_config import load_service_config


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


# -- a failed run is restarted from its checkpoint, a crash loop is not --------------------------

def _scripted(daemon: Daemon, outcomes: list[tuple[int, int]]) -> list[int]:
    """Replace one supervision attempt by the next (exit code, rounds completed by then) of
    ``outcomes``; returns the list of attempts made."""
    from fedge.server.daemon import serve

    made: list[int] = []

    def attempt(rows_log) -> int:  # noqa: ANN001 - the MetricsLog the daemon passes
        code, rounds = outcomes[len(made)]
        made.append(code)
        daemon._round = rounds
        return serve._FAILED if code < 0 else code

    daemon._attempt_once = attempt  # type: ignore[method-assign]
    daemon.restart_backoff = 0.01
    return made


def test_a_failed_run_is_restarted_and_finishes(daemon: Daemon, caplog) -> None:
    made = _scripted(daemon, [(-1, 2), (-1, 2), (0, 5)])
    with caplog.at_level("WARNING", logger="fedge.serve"):
        assert daemon.run() == 0
    assert made == [-1, -1, 0]
    assert caplog.text.count("restarting the SuperLink and the run") == 2


def test_a_crash_loop_gives_up_after_run_retries(daemon: Daemon, caplog) -> None:
    retries = daemon.config.run_retries
    made = _scripted(daemon, [(-1, 1)] * (retries + 2))
    with caplog.at_level("ERROR", logger="fedge.serve"):
        assert daemon.run() == 1
    assert len(made) == retries + 1 and "giving up" in caplog.text


def test_failures_between_completed_rounds_are_not_a_crash_loop(daemon: Daemon) -> None:
    retries = daemon.config.run_retries
    outcomes = [(-1, r) for r in range(1, retries + 4)] + [(0, retries + 4)]
    made = _scripted(daemon, outcomes)
    assert daemon.run() == 0 and len(made) == len(outcomes)


def test_sigterm_while_waiting_to_restart_exits_0(daemon: Daemon) -> None:
    made = _scripted(daemon, [(-1, 1), (0, 2)])
    daemon.restart_backoff = 30.0
    daemon.stop.set()
    assert daemon.run() == 0 and made == [-1]


def test_run_retries_is_validated(tmp_path: Path) -> None:
    from fedge.server.daemon.service_config import ServiceConfigError

    path = tmp_path / "fedge.toml"
    path.write_text('[service]\naddress = "127.0.0.1:9093"\nrun-retries = 0\n\n[run]\nrounds = 2\n')
    assert load_service_config(path).run_retries == 0
    path.write_text('[service]\naddress = "127.0.0.1:9093"\nrun-retries = -1\n\n[run]\nrounds = 2\n')
    with pytest.raises(ServiceConfigError, match="run-retries"):
        load_service_config(path)
