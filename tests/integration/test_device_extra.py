"""``fedge[device]`` is enough for a device that trains: a fresh virtual environment with only the
built wheel's device extra (no flwr-datasets, scikit-learn, Ray, ONNX exporter) runs ``fedge-edge
join`` with its own ``.npz`` against a real SuperLink on 127.0.0.1, and the coordinator (this
environment, the platform install) trains a model with it. The ClientApp process runs in the
device's environment, so every import it makes must be satisfied there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fedge.launcher.environment import flower_environment
from fedge.launcher.processes import ProcessGroup
from fedge.launcher.sequence import FlowerLaunch
from fedge.server.flower_app import stage_fedge_app
from fedge.server.settings import RunSettings
from fedge.tasks import make_task
from tests.test_packaging import source_tree

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
_QUIET = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def test_a_device_extra_environment_joins_and_trains(tmp_path: Path, assert_no_leftovers) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(source_tree(tmp_path))],
                   check=True, timeout=300, env={**os.environ, **_QUIET})
    (wheel,) = wheels.glob("fedge-*.whl")
    device = tmp_path / "device-venv"
    subprocess.run([sys.executable, "-m", "venv", str(device)], check=True, timeout=120)
    subprocess.run([str(device / "bin" / "pip"), "install", "-q", "-c", str(ROOT / "constraints.txt"),
                    f"{wheel}[device]"], check=True, timeout=900, env={**os.environ, **_QUIET})
    listed = subprocess.run([str(device / "bin" / "pip"), "list", "--format=json"], capture_output=True, text=True,
                            check=True).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert {"torch", "flwr", "onnxruntime"} <= names
    assert not names & {"flwr-datasets", "scikit-learn", "ray", "onnx", "matplotlib"}, sorted(names)

    pool = make_task("digits").train_pool()  # the device's own data: 900 digits
    own = tmp_path / "own.npz"
    np.savez(own, x=pool.x[:900].numpy(), y=pool.y[:900].numpy())

    run_dir = tmp_path / "run"
    home = tmp_path / "flwr-home"
    settings = RunSettings(rounds=2, clients_per_round=1, local_epochs=5, wait_for_nodes=120, round_timeout=300,
                           run_dir=str(run_dir))
    with ProcessGroup(tmp_path / "logs", env=flower_environment(home), also_match={"FLWR_HOME": str(home)}) as group:
        flower = FlowerLaunch(group, home)
        flower.start_superlink(cwd=tmp_path)
        device_env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
        device_env["PATH"] = f"{device / 'bin'}{os.pathsep}{device_env.get('PATH', '')}"
        group.start("device", [str(device / "bin" / "fedge-edge"), "join", "--superlink", flower.address, "--insecure",
                               "--data", str(own), "--state-dir", str(tmp_path / "device-state"),
                               "--max-restarts", "0"], cwd=tmp_path, env=device_env)
        runner = flower.submit(stage_fedge_app(home / "app"), settings.to_run_config(), cwd=tmp_path)
        flower.follow(runner, time.monotonic() + 900)
        assert runner.popen.returncode == 0, runner.log_tail(40)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["final_accuracy"] > summary["initial_accuracy"] + 0.2, summary
    clientapp_logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "device-state").rglob("*.log"))
    assert "ModuleNotFoundError" not in clientapp_logs
    assert_no_leftovers(home)
    assert_no_leftovers(tmp_path / "device-state" / "flwr-home")
