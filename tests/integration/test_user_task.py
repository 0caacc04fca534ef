"""A user's own task, outside the Fedge package, on every path: ``fedge new`` + ``flwr run .``,
``fedge demo --app`` with its own metric driving progress, plot and stop rule, export to a signed
bundle and ``fedge-edge infer``, and a task by import path on the deployment engine (its module
travels in the app bundle). Real processes on 127.0.0.1, each with its own FLWR_HOME."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedge.launcher.environment import flower_environment
from tests.flower_home import run_flwr, stop_flower_home

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


# In `make test-slow`: the default suite runs the same (`fedge new`, `flwr run .`) from the installed
# wheel in tests/test_packaging.py; this one also checks the accuracy it reaches.
@pytest.mark.slow
@pytest.mark.xdist_group("flwr-default-federation")  # `flwr run .` uses Flower's fixed local ports
def test_fedge_new_then_flwr_run_trains_on_flowers_default_federation(tmp_path, assert_no_leftovers) -> None:
    _run([str(BIN / "fedge"), "new", "myapp"], cwd=tmp_path)
    app = tmp_path / "myapp"
    assert sorted(p.name for p in app.iterdir()) == ["README.md", "pyproject.toml", "task.py"]
    home = tmp_path / "flwr-home"
    env = flower_environment(home)
    # Flower's own command on its default local simulation (2 SuperNodes): nothing of Fedge's
    # launcher, the app's components are Fedge's ServerApp and ClientApp, its code is task.py
    try:
        done = run_flwr([str(BIN / "flwr"), "run", ".", "--stream", "--run-config", "rounds=3"], cwd=app, env=env,
                        home=home, timeout=600)
    finally:
        stop_flower_home(home)  # flwr leaves its SuperLink running on Flower's fixed ports
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert_no_leftovers(home)
    (summary_path,) = app.glob("runs/run-*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["rounds"] == 3 and summary["metric"] == "accuracy", out[-2000:]
    assert summary["final_accuracy"] > 0.6, summary  # wine, 3 classes, 2 devices


# In `make test-slow` (time budget): the default suite runs the classification template's README
# commands from the wheel (tests/test_packaging.py); a task's own metric through the engine, the stop
# rule and federated evaluation are in tests/server/test_federated_evaluation.py.
@pytest.mark.slow
def test_regression_template_end_to_end_with_its_own_metric(tmp_path, assert_no_leftovers) -> None:
    _run([str(BIN / "fedge"), "new", "reg", "--template", "regression"], cwd=tmp_path)
    app, run = tmp_path / "reg", tmp_path / "run"
    out = _run([str(BIN / "fedge"), "demo", "--app", "reg", "--clients", "3", "--rounds", "12",
                "--partitioning", "dirichlet:alpha=1.0", "--stop-at", "mse<=0.55", "--export-bundle", "auto",
                "--run-dir", str(run)], cwd=tmp_path)
    assert_no_leftovers(run / "flwr-home")
    assert "held-out mse" in out and "mse " in out  # progress and summary speak the task's metric
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["metric"] == "mse" and r["metrics"] == ["loss", "mse", "mae"] for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_mse"] <= 0.55 < summary["initial_mse"], summary
    assert summary["stopped_at"] == "mse<=0.55" and summary["rounds"] == len(rows) < 12  # the stop rule
    assert (run / "plot.png").stat().st_size > 10_000
    bundle_facts = summary["bundle"]  # the run's own export: signed, or refused by the gate on MSE (1% of fp32)
    assert bundle_facts.get("metric") == "mse" or "worse than fp32" in bundle_facts["error"], bundle_facts
    # export again from the model file, in the app's directory (its task.py imports from there),
    # then a device verifies and runs it: a regression's predictions are its outputs
    bundle = tmp_path / "bundle"
    _run([str(BIN / "fedge"), "export", str(run / "model.pt"), "--sign-key", str(run / "keys" / "signing-key.pem"),
          "--out", str(bundle), "--max-accuracy-drop", "10"], cwd=app)
    x = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    report = json.loads(_run([str(BIN / "fedge-edge"), "infer", str(bundle), "--trusted-key",
                              str(run / "keys" / "signing-key.pub.pem"), "--input", str(tmp_path / "x.npy"),
                              "--state", str(tmp_path / "device-state.json")],  # its own anti-rollback record
                             cwd=tmp_path))
    assert report["verified"] and report["task"] == "task:DiabetesTask" and "mse" in report
    assert len(report["predictions"]) == 4 and all(isinstance(p, float) for p in report["predictions"])


# In `make test-slow` (time budget): staging a user's modules into the app bundle runs in the default
# suite on the simulation engine (test_plugin_examples.py), the deployment engine's ClientApp processes
# in test_deployment_engine.py and test_serve.py.
@pytest.mark.slow
def test_a_task_by_import_path_runs_on_the_deployment_engine(tmp_path, assert_no_leftovers) -> None:
    """A module in the user's directory, named on the command line: staged into the app bundle,
    imported by the ServerApp and by every ClientApp process the SuperNodes start."""
    shutil.copy(Path(__file__).parents[1] / "tasks" / "user_tasks.py", tmp_path / "my_tasks.py")
    run = tmp_path / "run"
    _run([str(BIN / "fedge"), "local-cluster", "--task", "my_tasks:SineTask:samples=200", "--partitioning", "iid",
          "--supernodes", "2", "--rounds", "2", "--local-epochs", "3", "--run-dir", str(run)], cwd=tmp_path)
    assert_no_leftovers(run / "flwr-home")
    assert (run / "flwr-home" / "app" / "my_tasks.py").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["metric"] == "mae" and summary["final_mae"] < summary["initial_mae"], summary


def test_a_wrong_task_path_fails_before_anything_starts(tmp_path) -> None:
    done = subprocess.run([str(BIN / "fedge"), "demo", "--task", "my_missing_module:Task", "--run-dir",
                           str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "cannot import module 'my_missing_module'" in done.stderr
    assert not (tmp_path / "run" / "flwr-home").exists()
