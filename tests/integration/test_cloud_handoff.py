"""Cloud pretraining hands off to federated fine-tuning: deploy.train's model.pt as --init."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server.engines import launch
from server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_pretrained_init_starts_the_federation_above_random(tmp_path, assert_no_leftovers) -> None:
    cloud = tmp_path / "cloud"
    # a world of one without torchrun: the same trainer, process group of size 1
    done = subprocess.run([sys.executable, "-m", "deploy.train", "--epochs", "4", "--out", str(cloud)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]

    settings = RunSettings(rounds=1, clients_per_round=2, init=str(cloud / "model.pt"),
                           run_dir=str(tmp_path / "fed"))
    pretrained = launch(settings, engine="simulation", num_supernodes=2, timeout=240)
    assert_no_leftovers(pretrained.run_dir / "flwr-home")
    assert pretrained.summary["initial_accuracy"] > 0.85  # a random init is near 10%
    assert pretrained.summary["final_accuracy"] > 0.85
