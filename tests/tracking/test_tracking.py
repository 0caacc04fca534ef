"""Experiment tracking (``fedge.tracking``): what a row becomes, the setting's grammar, a failing sink,
a resumed MLflow run. A real run read back with TensorBoard's and MLflow's own readers:
``tests/integration/test_watching_a_run.py``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedge.tracking import SinkSpec, Tracker, TrackingError, check_tracking, parse_tracking, row_scalars

def test_a_row_becomes_its_finite_numbers_by_flat_name_with_ratio_and_refusals_by_kind() -> None:
    row = {"round": 3, "accuracy": 0.9, "loss": float("nan"), "uplink_bytes": 100, "uplink_fp32_bytes": 800,
           "codec": "qsgd:bits=4", "error_feedback": True, "metrics": ["loss", "accuracy"],
           "participation": {"jain": 0.5, "inner": {"x": 2}},
           "rejected": [{"node": 1, "kind": "timeout"}, {"node": 2, "kind": "timeout"}, {"node": 3}],
           "declined": {"over-budget": 1}}
    assert row_scalars(row) == {"accuracy": 0.9, "uplink_bytes": 100.0, "uplink_fp32_bytes": 800.0,
                                "participation/jain": 0.5, "participation/inner/x": 2.0,
                                "declined/over-budget": 1.0, "compression_ratio": 8.0,
                                "rejected/timeout": 2.0, "rejected/other": 1.0}


@given(st.dictionaries(st.text(st.characters(codec="ascii", exclude_characters="/"), min_size=1),
                       st.one_of(st.floats(), st.integers(-2**40, 2**40), st.booleans(), st.text(), st.none()),
                       max_size=8))
def test_every_scalar_is_a_finite_float_of_the_row(row: dict) -> None:
    row = {k: v for k, v in row.items() if k not in ("round", "rejected", "uplink_bytes", "uplink_fp32_bytes")}
    scalars = row_scalars(row)
    assert all(isinstance(v, float) and math.isfinite(v) for v in scalars.values())
    assert scalars == {k: float(v) for k, v in row.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def test_the_setting_names_sinks_with_targets_that_may_hold_colons() -> None:
    assert parse_tracking("none") == parse_tracking("") == []
    assert parse_tracking("tensorboard; mlflow:http://127.0.0.1:5000") == [
        SinkSpec("tensorboard"), SinkSpec("mlflow", "http://127.0.0.1:5000")]
    assert parse_tracking("tensorboard:runs/tb") == [SinkSpec("tensorboard", "runs/tb")]
    with pytest.raises(TrackingError, match="unknown tracking sink 'wandb'"):
        parse_tracking("wandb")
    with pytest.raises(TrackingError, match="twice"):
        parse_tracking("mlflow;mlflow:sqlite:///x.db")


def test_a_missing_library_is_refused_with_its_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from fedge.server.settings import RunSettings, SettingsError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(TrackingError, match=r"pip install 'fedge\[mlflow\]'"):
        check_tracking("tensorboard;mlflow")
    with pytest.raises(SettingsError, match=r"tracking: .*pip install 'fedge\[mlflow\]'"):
        RunSettings(tracking="mlflow")


class _Broken:
    name = "broken"

    def start(self, params: dict) -> None:
        pass

    def log(self, step: int, scalars: dict) -> None:
        raise ConnectionError("tracking server went away")

    def artifacts(self, paths: list) -> None:
        pass

    def close(self, finished: bool) -> None:
        pass


class _Kept(_Broken):
    name = "kept"

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log(self, step: int, scalars: dict) -> None:
        self.steps.append(step)


def test_a_failing_sink_is_dropped_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    kept = _Kept()
    tracker = Tracker([_Broken(), kept])
    for step in (1, 2):
        tracker.row({"round": step, "accuracy": 0.5})
    assert kept.steps == [1, 2] and [s.name for s in tracker.sinks] == ["kept"]
    assert "broken failed in log (ConnectionError: tracking server went away)" in caplog.text


def test_a_resumed_run_continues_its_mlflow_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    first = Tracker.open("mlflow", tmp_path)
    first.start({"rounds": 2, "codec": "none"})
    first.row({"round": 1, "accuracy": 0.5})
    first.close(finished=False)  # stopped at the operator's request
    again = Tracker.open("mlflow", tmp_path)
    again.start({"rounds": 4, "codec": "none"})  # rounds may change on resume
    again.row({"round": 2, "accuracy": 0.75})
    again.close(finished=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fedge").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["rounds"] == "2" and run.data.tags["resumed.rounds"] == "4"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "accuracy")] == [(1, 0.5), (2, 0.75)]
