"""``fedge.flower.tracked``: a Flower app's rounds in TensorBoard, in-process (a Grid stand-in that
runs each node's ClientApp): Flower's own round loop around ``compressed(FedAvg)``, and FedBuff's
own loop, each read back with TensorBoard's event reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedge.flower import FedBuff, compressed, tracked
from fedge.tracking import TrackingError
from tests.flower.test_compressed_strategy import NODES, _model, _user_app
from tests.flower.test_fedbuff_strategy import Clock, LatencyGrid


class RoundGrid(LatencyGrid):
    """What Flower's round loop asks of a grid: every reply at once."""

    def send_and_receive(self, messages, timeout=None):  # type: ignore[no-untyped-def]
        return self.pull_messages(self.push_messages(list(messages)))


def _events(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _norm(version: int, arrays: ArrayRecord) -> MetricRecord:
    return MetricRecord({"norm": float(sum(np.abs(a.numpy()).sum() for a in arrays.values()))})


def test_flowers_round_loop_logs_train_evaluate_and_server_metrics_each_round(tmp_path: Path) -> None:
    grid = RoundGrid({n: _user_app() for n in NODES}, {n: 0.0 for n in NODES}, Clock())
    strategy = tracked(compressed(FedAvg(fraction_evaluate=0.0), uplink="qsgd:bits=4"), "tensorboard",
                       run_dir=tmp_path / "run", params={"lr": 0.1})
    result = strategy.start(grid, _model(), num_rounds=2, train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=_norm)
    logged = _events(tmp_path / "run" / "tensorboard")
    for round_, metrics in result.train_metrics_clientapp.items():
        for name, value in metrics.items():
            if isinstance(value, (int, float)):
                assert logged[f"train/{name}"][round_] == pytest.approx(value, rel=1e-6), name
    assert "train/fedge-uplink-bytes" in logged and sorted(logged["train/fedge-uplink-bytes"]) == [1, 2]
    assert logged["server/norm"] == pytest.approx({r: m["norm"] for r, m in result.evaluate_metrics_serverapp.items()})


def test_fedbuffs_own_loop_logs_each_version(tmp_path: Path) -> None:
    clock = Clock()
    grid = LatencyGrid({n: _user_app() for n in NODES}, {n: 1.0 for n in NODES}, clock)
    strategy = tracked(FedBuff(concurrency=3, buffer=3), "tensorboard", run_dir=tmp_path / "run")
    result = strategy.start(grid, _model(), 3, evaluate_fn=_norm, clock=clock, sleep=clock.sleep)
    logged = _events(tmp_path / "run" / "tensorboard")
    assert sorted(logged["server/norm"]) == [0, 1, 2, 3]
    staleness = {v: m["staleness-mean"] for v, m in result.train_metrics_clientapp.items()
                 if "staleness-mean" in m}
    assert staleness and logged["train/staleness-mean"] == pytest.approx(staleness)


def test_an_unknown_sink_is_refused_when_the_strategy_is_built() -> None:
    with pytest.raises(TrackingError, match="unknown tracking sink"):
        tracked(FedAvg(), "wandb")
