import json
import os

import pytest
import torch

from fedge.server.run.checkpoint import Checkpoint, CheckpointError, CheckpointStore
from fedge.server.run.metrics_log import MetricsLog
from fedge.server.run.run_directory import RunDirectory
from fedge.server.settings import RunSettings, SettingsError


def _ckpt(round_: int) -> Checkpoint:
    return Checkpoint(round=round_, algorithm="fedavg", task="digits", numel=10,
                      state={"params": torch.full((10,), float(round_)), "optimizer": {"m": torch.ones(10)}})


def test_checkpoint_round_trip_and_previous_kept(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.load() is None
    store.save(_ckpt(1))
    store.save(_ckpt(2))
    loaded = store.load()
    assert loaded.round == 2 and torch.equal(loaded.state["params"], torch.full((10,), 2.0))
    assert loaded.state["optimizer"]["m"].sum() == 10
    assert store.previous.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(_ckpt(1))
    store.save(_ckpt(2))
    data = store.current.read_bytes()
    store.current.write_bytes(data[: len(data) // 2])
    assert store.load().round == 1
    assert len(list(tmp_path.glob("state.corrupt-*.pt"))) == 1  # set aside, not rotated over prev
    store.save(_ckpt(3))
    assert store.load().round == 3
    assert CheckpointStore(tmp_path).previous.exists()
    store.previous.write_bytes(b"garbage")
    store.current.write_bytes(b"garbage too")
    with pytest.raises(CheckpointError):
        store.load()


def test_non_finite_state_is_refused(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    bad = _ckpt(1)
    bad.state["optimizer"]["m"] = torch.full((10,), float("nan"))
    store.save(bad)
    with pytest.raises(CheckpointError, match="NaN"):
        store.load()


def test_metrics_truncation_and_torn_line(tmp_path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for r in (1, 2, 3):
        log.append({"round": r, "accuracy": 0.5})
    with open(log.path, "a") as handle:
        handle.write('{"round": 4, "acc')  # crash mid-write
    assert [r["round"] for r in log.read()] == [1, 2, 3]
    log.append({"round": 3.5, "loss": float("nan"), "nested": [float("inf")]})
    assert log.read()[-1] == {"round": 3.5, "loss": None, "nested": [None]}
    log.truncate_after(2)
    assert [r["round"] for r in log.read()] == [1, 2]
    assert log.path.read_text().endswith("\n")


def test_run_directory_refuses_incompatible_resume(tmp_path) -> None:
    run = RunDirectory(tmp_path / "run")
    run.start(RunSettings(rounds=5))
    assert json.loads(run.config_path.read_text())["settings"]["rounds"] == 5
    run.start(RunSettings(rounds=9))  # more rounds: fine
    with pytest.raises(SettingsError, match="codec"):
        run.start(RunSettings(codec="fp16"))
    assert os.path.exists(run.config_path)


def test_a_run_recorded_before_a_setting_existed_resumes_at_its_default_and_refuses_another(tmp_path) -> None:
    run = RunDirectory(tmp_path / "run")
    run.start(RunSettings(rounds=5))
    recorded = json.loads(run.config_path.read_text())
    del recorded["settings"]["weight-decay"]  # as a run started before the setting was added
    run.config_path.write_text(json.dumps(recorded))
    run.start(RunSettings(rounds=5))  # the default: what that run trained with
    with pytest.raises(SettingsError, match=r"weight-decay: 0\.0 -> 0\.001"):
        run.start(RunSettings(rounds=5, weight_decay=0.001))


def test_a_launch_its_run_directory_cannot_resume_is_refused_before_anything_there_changes(tmp_path) -> None:
    """A finished run, launched again with a setting it cannot resume under: refused by the launcher
    before it drops the summary or any metrics row (the ServerApp would refuse it too, but only once
    the launcher had cleared the directory for a new launch), with no process started."""
    from fedge.server.local import launch

    path = tmp_path / "run"
    run = RunDirectory(path)
    run.start(RunSettings(rounds=2, run_dir=str(path)))
    MetricsLog(run.path / "metrics.jsonl").append({"round": 1, "accuracy": 0.5})
    MetricsLog(run.path / "metrics.jsonl").append({"round": 2, "accuracy": 0.6})  # past any checkpoint
    run.write_summary({"rounds": 2})
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with pytest.raises(SettingsError, match=r"different settings \(codec: 'qsgd:bits=4\S* -> 'fp16'\)"):
        launch(RunSettings(rounds=2, codec="fp16", run_dir=str(path)), engine="simulation", num_supernodes=2)
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert not (path / "logs").exists() and not (path / "flwr-home").exists()  # nothing was started
    run.prepare_launch(RunSettings(rounds=5, run_dir=str(path)))  # more rounds resume: cleared for the launch
    assert not run.summary_path.exists() and MetricsLog(run.path / "metrics.jsonl").read() == []
