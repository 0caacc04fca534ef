"""Flower's ``flwr`` command in one long-lived process (``fedge.launcher.flower_cli``): every call
answered in order by the same process with Flower's own reply, a call that outlives its timeout
ends the helper without holding the next call, and a helper that died is started again. A real
SuperLink answering through it: ``tests/integration/test_tls.py`` (registration) and
``tests/integration/test_serve.py`` (the daemon's node poll)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from fedge.launcher.environment import flower_environment
from fedge.launcher.federation import write_connection
from fedge.launcher.flower_cli import FlowerCli, FlowerCliError, json_replies


@pytest.fixture
def flwr(tmp_path: Path):
    home = tmp_path / "flwr-home"
    write_connection(home, "fedge", "127.0.0.1:9", None)  # nothing listens on port 9
    with FlowerCli(flower_environment(home), cwd=tmp_path) as cli:
        yield cli


def test_calls_are_answered_by_one_process_with_flowers_own_replies(flwr: FlowerCli) -> None:
    code, text = flwr.call(["supernode", "ls", "nosuch", "--format", "json"], timeout=60)
    (reply,) = json_replies(text)
    assert reply["success"] is False and "'nosuch' not found" in reply["error-message"]
    assert code == 0  # as `flwr` itself exits: under --format json, Flower's errors are answers
    first = flwr.pid
    code, text = flwr.call(["supernode", "ls", "fedge", "--format", "json"], timeout=60)
    (reply,) = json_replies(text)
    assert reply["success"] is False and "SuperLink is unavailable" in reply["error-message"]
    code, text = flwr.call(["no-such-command"], timeout=60)  # click's usage error: a code, not a dead helper
    assert code == 2 and json_replies(text) == []
    assert flwr.pid == first is not None


def test_a_call_past_its_timeout_ends_the_helper_and_the_next_one_starts_another(flwr: FlowerCli) -> None:
    with pytest.raises(FlowerCliError, match="no answer within"):
        flwr.call(["supernode", "ls", "nosuch", "--format", "json"], timeout=0.01)  # Flower's imports take longer
    assert flwr.pid is None
    _, text = flwr.call(["supernode", "ls", "nosuch", "--format", "json"], timeout=60)
    assert "'nosuch' not found" in json_replies(text)[0]["error-message"]


def test_a_helper_that_died_is_started_again(flwr: FlowerCli) -> None:
    flwr.call(["supernode", "ls", "nosuch", "--format", "json"], timeout=60)
    dead = flwr.pid
    assert dead is not None
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while flwr.pid is not None and time.monotonic() < deadline:  # the kill lands
        time.sleep(0.05)
    _, text = flwr.call(["supernode", "ls", "nosuch", "--format", "json"], timeout=60)
    assert json_replies(text)[0]["success"] is False and flwr.pid not in (None, dead)


def test_a_module_planted_in_the_helpers_directory_never_runs(tmp_path: Path) -> None:
    """Privacy audit 3, F4: ``python -m`` put the working directory (a node key's, for
    ``fedge certs register``) first on the import path, so a ``json.py`` there ran as the operator.
    The helper now runs without it on the path: the call is answered, and the planted module is
    never imported."""
    keys = tmp_path / "keys"
    keys.mkdir()
    ran = tmp_path / "planted-ran"
    for name in ("json", "click", "typer"):  # modules the helper and flwr import early
        (keys / f"{name}.py").write_text(f"open({str(ran)!r}, 'a').write('{name}')\nraise SystemExit(9)\n")
    home = tmp_path / "flwr-home"
    write_connection(home, "fedge", "127.0.0.1:9", None)
    with FlowerCli(flower_environment(home), cwd=keys) as cli:
        code, text = cli.call(["supernode", "ls", "nosuch", "--format", "json"], timeout=60)
    (reply,) = json_replies(text)
    assert reply["success"] is False and code == 0
    assert not ran.exists()
