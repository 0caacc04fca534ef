"""Flower's simulation on a two-node Ray cluster on 127.0.0.1: ``ray start --head`` and ``ray start
--address`` as on two machines (docs/operations.md, "Beyond one machine").

The head declares no CPU and the worker two, so every ClientApp must run on the second node: a run
that finishes has trained across nodes. Both nodes run in their own process groups, killed at the end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedge.launcher.processes import free_port
from fedge.server.local import launch
from fedge.server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BIN = Path(sys.executable).parent


def _port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _nodes_alive(address: str) -> int:
    probe = ("import ray; ray.init(address=%r, logging_level='ERROR'); "
             "print(sum(1 for n in ray.nodes() if n['Alive']))") % address
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else 0


def test_a_run_on_a_two_node_ray_cluster(tmp_path, assert_no_leftovers) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--block", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    nodes = [subprocess.Popen([str(BIN / "ray"), "start", "--head", "--port", str(port), "--num-cpus", "0",
                               "--include-dashboard", "false", "--temp-dir", temp, *common],
                              env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 90
        while not _port_open(port):  # the head's GCS listens: a worker can join
            assert time.monotonic() < deadline, "the Ray head did not come up"
            time.sleep(0.5)
        nodes.append(subprocess.Popen([str(BIN / "ray"), "start", "--address", address, "--num-cpus", "2", *common],
                                      env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        while _nodes_alive(address) < 2:
            assert time.monotonic() < deadline, "the Ray worker node did not join"
            time.sleep(2)
        settings = RunSettings(rounds=2, clients_per_round=4, local_epochs=2, run_dir=str(tmp_path / "run"))
        result = launch(settings, engine="simulation", num_supernodes=4, timeout=200, ray_address=address)
        assert_no_leftovers(result.run_dir / "flwr-home")
        assert [row["round"] for row in result.rows] == [1, 2]
        assert all(row["clients_used"] == 4 and not row["rejected"] for row in result.rows)
        assert result.summary["final_accuracy"] > result.summary["initial_accuracy"]
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_runs_own_ray_head_that_cannot_start_fails_the_run_at_once(tmp_path, monkeypatch, assert_no_leftovers) -> None:
    """A simulation joins its own Ray head through RAY_ADDRESS, and ray.init() waits minutes for a
    GCS that never comes: a head that exits (here: a CPU count Ray refuses) must end the run with
    its log, not leave it waiting for its timeout."""
    import fedge.server.local as local
    from fedge.server.local import EngineError

    start_head = local._start_ray_head
    monkeypatch.setattr(local, "_start_ray_head", lambda group, address, cpus, cwd: start_head(group, address, -1, cwd))
    began = time.monotonic()
    with pytest.raises(EngineError, match="ray-head exited with code 1") as failure:
        launch(RunSettings(rounds=1, clients_per_round=2, local_epochs=1, run_dir=str(tmp_path / "run")),
               engine="simulation", num_supernodes=2, timeout=240)
    assert time.monotonic() - began < 90
    assert "Resource quantities must be nonnegative" in str(failure.value)
    assert_no_leftovers(tmp_path / "run" / "flwr-home")
