"""Ctrl-C on `fedge local-cluster` stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fedge.launcher.processes import processes_with_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


# Under `make test-slow` (time budget). The default suite stops a daemon and its processes on SIGTERM
# (tests/integration/test_serve.py) and checks every launcher's process group is stopped
# (assert_no_leftovers in every integration test).
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_every_started_process(tmp_path, sig) -> None:
    run_dir = tmp_path / "run"
    flwr_home = str((run_dir / "flwr-home").resolve())
    cli = subprocess.Popen(
        [sys.executable, "-m", "fedge.server.cli", "local-cluster", "--supernodes", "2", "--rounds", "50",
         "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        # wait until the SuperLink and both SuperNodes run (3 processes carry the run's FLWR_HOME)
        while time.monotonic() < deadline and len(processes_with_env("FLWR_HOME", flwr_home)) < 3:
            time.sleep(0.5)
        assert len(processes_with_env("FLWR_HOME", flwr_home)) >= 3, "cluster did not come up"
        cli.send_signal(sig)
        out, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
        for pid in processes_with_env("FLWR_HOME", flwr_home):  # a failed start must not leave a cluster behind
            os.kill(pid, signal.SIGKILL)
    assert cli.returncode == 130, err
    assert "all started processes were stopped" in err
    assert processes_with_env("FLWR_HOME", flwr_home) == []
