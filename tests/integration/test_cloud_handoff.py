"""Cloud pretraining hands off to federated fine-tuning: deploy.train's model.pt as --init."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedge.server.run.initial_model import initial_params
from fedge.server.settings import RunSettings
from fedge.tasks import make_task

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_pretrained_init_starts_the_federation_above_random(tmp_path) -> None:
    cloud = tmp_path / "cloud"
    # a world of one without torchrun: the same trainer, process group of size 1
    done = subprocess.run([sys.executable, "-m", "fedge.deploy.train", "--epochs", "4", "--out", str(cloud)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]

    # The coordinator's starting point (what it evaluates as "initial_accuracy" before round 1).
    from fedge.server.engine.loop import make_context

    task = make_task("digits")
    ctx = make_context(RunSettings(run_dir=str(tmp_path / "fed")), task)
    random_accuracy = ctx.evaluate(initial_params(task, 42))["accuracy"]
    pretrained_accuracy = ctx.evaluate(initial_params(task, 42, str(cloud / "model.pt")))["accuracy"]
    assert random_accuracy < 0.3 and pretrained_accuracy > 0.85

    from fedge.deploy.model_file import ModelFileError

    with pytest.raises(ModelFileError):
        initial_params(make_task("synthetic"), 42, str(cloud / "model.pt"))
