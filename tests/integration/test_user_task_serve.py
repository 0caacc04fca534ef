"""A user's regression task (outside Fedge, by import path) on the coordinator daemon with two
devices that join with their own data files: ``fedge serve`` stages the task's module into the app
bundle, each ``fedge-edge join`` checks its file against the task and, pinned to its installed code, imports
the module from its owner's copy (on its ``PYTHONPATH``, allowed with ``--allow-module``), never from
the bundle.

In ``make test-slow``: the default suite already runs the daemon with joined devices over TLS
(``test_serve.py``) and the user task on the deployment engine (``test_user_task.py``); this
combination adds about three minutes, over the default suite's 15-minute budget on 2 cores."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedge.launcher.processes import free_port, processes_with_env
from tests.integration.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

BIN = Path(sys.executable).parent


def test_serve_and_two_joined_devices_train_a_users_regression_task(tmp_path: Path, assert_no_leftovers) -> None:
    shutil.copy(Path(__file__).parents[1] / "tasks" / "user_tasks.py", tmp_path / "my_tasks.py")
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(5)
    for i in range(2):  # each device's own data: a regression of its own (floats as targets)
        x = rng.standard_normal((150, 5)).astype(np.float32)
        np.savez(tmp_path / f"device-{i}.npz", x=x, y=(x @ weights).astype(np.float32))
    port = free_port()
    (tmp_path / "fedge.toml").write_text(f"""
[service]
address = "127.0.0.1:{port}"
state-dir = "state"
metrics-address = ""
page-address = ""
insecure = true
node-poll-seconds = 5

[run]
task = "my_tasks:LinearRegressionTask"
rounds = 3
clients-per-round = 2
local-epochs = 3
lr = 0.05
wait-for-nodes = 300
round-timeout = 240
""")
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("serve", "join-0", "join-1")}
    processes = [subprocess.Popen([str(BIN / "fedge"), "serve", "--config", "fedge.toml"], cwd=tmp_path, env=env,
                                  stdout=logs["serve"], stderr=subprocess.STDOUT, start_new_session=True)]
    try:
        wait_for(lambda: "run submitted" in (tmp_path / "serve.log").read_text(), 180, "the daemon to submit the run")
        for i in range(2):
            processes.append(subprocess.Popen(
                [str(BIN / "fedge-edge"), "join", "--superlink", f"127.0.0.1:{port}", "--insecure", "--task",
                 "my_tasks:LinearRegressionTask", "--data", f"device-{i}.npz", "--state-dir", f"device-{i}",
                 "--allow-module", "my_tasks"],  # the device imports its owner's copy, never the bundle's
                cwd=tmp_path, env={**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path),
                                                                                      env.get("PYTHONPATH")]))}, stdout=logs[f"join-{i}"], stderr=subprocess.STDOUT, start_new_session=True))
        summary = tmp_path / "state" / "run" / "summary.json"
        wait_for(lambda: summary.exists() or processes[0].poll() is not None, 600, "the run to finish")
        assert summary.exists(), (tmp_path / "serve.log").read_text()[-4000:]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        for handle in logs.values():
            handle.close()
        for home in (tmp_path / "state" / "flwr-home", tmp_path / "device-0" / "flwr-home", tmp_path / "device-1" / "flwr-home"):
            for pid in processes_with_env("FLWR_HOME", str(home.resolve()), under=True):
                os.kill(pid, signal.SIGKILL)
    result = json.loads(summary.read_text())
    assert result["rounds"] == 3 and result["metric"] == "mse"
    assert result["final_mse"] < result["initial_mse"], result
    rows = [json.loads(line) for line in (tmp_path / "state" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["clients_used"] == 2 and not r["rejected"] for r in rows), rows
    assert (tmp_path / "state" / "flwr-home" / "app" / "my_tasks.py").is_file()
    assert_no_leftovers(tmp_path / "state" / "flwr-home")
