"""The public Task API: tasks by import path and by plugin, any Dataset, the task's own loss and
metrics, partitioning without labels, and the devices' held-out split."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedge.compression.errors import SpecError
from fedge.edge_client.node_data import holdout_split
from fedge.edge_client.trainer import train_local
from fedge.tasks import Task, TaskNotFoundError, TensorData, evaluate, make_task
from fedge.tasks.data_files import DataFileError, validate_arrays
from fedge.tasks.registry import import_path_of, task_module

USER = "tests.tasks.user_tasks"


def test_a_task_by_import_path_takes_typed_parameters_and_keeps_its_path_as_spec() -> None:
    task = make_task(f"{USER}:SineTask:hidden=4,samples=50")
    assert task.spec == f"{USER}:SineTask:hidden=4,samples=50" and task.hidden == 4
    assert len(task.train_pool()) == 50
    # a subclass of a built-in is rebuilt from its own path everywhere, not as the built-in
    assert make_task(f"{USER}:DevicesOnlyDigits").spec == f"{USER}:DevicesOnlyDigits"
    assert task_module(f"{USER}:SineTask") == "tests" and task_module("digits:width=2") is None
    assert import_path_of("synthetic:hidden=8") is None and import_path_of("a.b:C:x=1") == ("a.b", "C", "x=1")


@pytest.mark.parametrize(("spec", "words"), [
    ("no_such_module_xyz:Task", "cannot import module 'no_such_module_xyz'"),
    (f"{USER}:Missing", "has no 'Missing'; Task classes there: DevicesOnlyDigits, DigitsTask, LinearRegressionTask, SineTask"),
    (f"{USER}:NotATask", "not a fedge.tasks.Task"),
    (f"{USER}:SineTask:depth=3", "has no parameter 'depth'"),
    ("no-such-builtin", "unknown task 'no-such-builtin'"),
    ("bad path:X", "an import path is"),
])
def test_a_wrong_task_fails_at_once_saying_what_it_tried(spec: str, words: str) -> None:
    started = time.perf_counter()
    with pytest.raises(SpecError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make_task(spec)
    assert time.perf_counter() - started < 1.0  # before any process starts (timed loosely: 1 s)


def test_an_installed_plugin_is_found_by_its_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution that declares ``[project.entry-points."fedge.tasks"]`` (here a hand-made
    dist-info on sys.path, which is what pip installs)."""
    info = tmp_path / "my_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[fedge.tasks]\nsine = {USER}:SineTask\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = make_task("sine:samples=40")
    assert type(task).__name__ == "SineTask" and len(task.train_pool()) == 40
    assert task.spec == "sine:samples=40"
    from fedge.tasks import available_tasks

    assert "sine" in available_tasks()


def test_training_takes_any_dataset_and_the_task_loss() -> None:
    task = make_task(f"{USER}:LinearRegressionTask")
    assert not isinstance(task.train_pool(), TensorData)  # the DataLoader path
    assert task.primary_metric == "mse" and not task.maximize and task.output == "prediction"
    torch.manual_seed(0)
    model = task.build_model()
    before = evaluate(model, task.test_data(), task)
    result = train_local(model, task.train_pool(), task, epochs=20, lr=0.05, batch_size=32,
                         generator=torch.Generator().manual_seed(0))
    after = evaluate(model, task.test_data(), task)
    assert set(after) == {"loss", "mse", "mae"} and after["loss"] == pytest.approx(after["mse"])
    assert after["mse"] < 0.05 < before["mse"], (before, after)
    assert result.examples == 400 and result.steps == 20 * 13


def test_a_sequence_model_trains() -> None:
    task = make_task(f"{USER}:SineTask")
    torch.manual_seed(0)
    model = task.build_model()
    before = evaluate(model, task.test_data(), task)["mae"]
    train_local(model, task.train_pool(), task, epochs=30, lr=0.1, batch_size=16, momentum=0.9,
                generator=torch.Generator().manual_seed(0))
    assert evaluate(model, task.test_data(), task)["mae"] < 0.5 * before


def test_partitioning_needs_labels_to_skew() -> None:
    task = make_task(f"{USER}:LinearRegressionTask")
    parts = [task.partition(i, 4, "iid") for i in range(4)]
    assert sum(len(p) for p in parts) == 400
    with pytest.raises(SpecError, match="has none: use 'iid'"):
        task.partition(0, 4, "dirichlet:alpha=0.5")


def test_holdout_split_is_disjoint_seeded_and_never_empty() -> None:
    data = TensorData(torch.arange(50.0).unsqueeze(1), torch.arange(50))
    train, held = holdout_split(data, 0.2, seed=7)
    assert len(held) == 10 and len(train) == 40
    assert set(train.y.tolist()).isdisjoint(held.y.tolist()) and set(train.y.tolist()) | set(held.y.tolist()) == set(range(50))
    assert torch.equal(holdout_split(data, 0.2, seed=7)[1].y, held.y)  # the same at every message
    assert not torch.equal(holdout_split(data, 0.2, seed=8)[1].y, held.y)
    tiny = TensorData(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long))
    assert [len(p) for p in holdout_split(tiny, 0.01, seed=1)] == [1, 1]


def test_own_data_files_follow_the_task_targets() -> None:
    regression = make_task(f"{USER}:LinearRegressionTask")
    x = np.zeros((3, 5), np.float32)
    assert validate_arrays(x, np.array([0.5, 1.0, 2.0]), regression).y.dtype == torch.float32
    with pytest.raises(DataFileError, match="NaN"):
        validate_arrays(x, np.array([0.5, np.nan, 2.0]), regression)
    with pytest.raises(DataFileError, match=r"needs \(N\)"):
        validate_arrays(x, np.zeros((3, 2)), regression)
    digits = make_task("digits")
    with pytest.raises(DataFileError, match="integer labels"):
        validate_arrays(np.zeros((3, 1, 8, 8), np.float32), np.array([0.5, 1.0, 2.0]), digits)


def test_a_task_must_name_its_input_shape() -> None:
    class Shapeless(Task):
        def build_model(self) -> torch.nn.Module:
            return torch.nn.Identity()

        def train_pool(self) -> TensorData:
            return TensorData(torch.zeros(1, 1), torch.zeros(1))

    from fedge.tasks import register_task

    register_task("shapeless", Shapeless)
    with pytest.raises(TaskNotFoundError, match="input_shape"):
        make_task("shapeless")
