"""The coordinator's per-reply validation, driven with real Flower records through the engine's
absorb path (what the FedAvg algorithm accepts, and why it refuses the rest)."""

from __future__ import annotations

import re

import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from fedge.compression import make_codec
from fedge.coordinator.driver import StepDriver
from fedge.coordinator.tally import Tally
from fedge.protocol.failures import Failure
from fedge.protocol import METRICS_RECORD, PAYLOAD_KEY, PAYLOAD_STYPE, UPDATE_RECORD
from fedge.server.engine.algorithm import Reply
from fedge.server.engine.loop import Engine, make_context
from fedge.server.algorithms.fedavg import FedAvg, FedAvgStep
from fedge.server.run.run_directory import RunDirectory
from fedge.server.settings import RunSettings
from fedge.tasks import make_task

N = 38_282


class _Error:
    def __init__(self, code: int, reason: str) -> None:
        self.code, self.reason = code, reason


class _Reply:
    """A pulled reply: only the envelope is stood in for (a real Message needs a running app)."""

    def __init__(self, content: RecordDict, node: int, error: _Error | None = None) -> None:
        self.content, self.error = content, error
        self.metadata = type("Metadata", (), {"src_node_id": node})()

    def has_error(self) -> bool:
        return self.error is not None


def _content(payload: bytes | None, metrics: dict | None) -> RecordDict:
    content = RecordDict()
    if payload is not None:
        content[UPDATE_RECORD] = ArrayRecord(
            {PAYLOAD_KEY: Array(dtype="uint8", shape=(len(payload),), stype=PAYLOAD_STYPE, data=payload)}
        )
    if metrics is not None:
        content[METRICS_RECORD] = MetricRecord(metrics)
    return content


def _take(engine: Engine, step: FedAvgStep, reply: _Reply) -> Failure | None:
    """One reply through the engine's door, as its loops take it (``fedge.coordinator.driver``)."""
    return engine._take(StepDriver(engine.layers, step, Tally(0.0)), reply)  # type: ignore[arg-type]


@pytest.fixture
def engine(tmp_path) -> Engine:
    settings = RunSettings(run_dir=str(tmp_path))
    algorithm = FedAvg(make_context(settings, make_task("digits")))
    algorithm.start(torch.zeros(N))
    return Engine(algorithm, RunDirectory(tmp_path))


@pytest.fixture
def step(engine: Engine) -> FedAvgStep:
    step = engine.algorithm.open_step(1, [7, 42])
    engine.algorithm.configure(step, [7, 42])
    return step


def test_valid_reply_is_accumulated(engine: Engine, step: FedAvgStep) -> None:
    payload = engine.algorithm.codec.encode(torch.randn(N))
    assert _take(engine, step, _Reply(_content(payload, {"num-examples": 10, "train-loss": 0.5}), 7)) is None
    assert step.aggregate.count == 1


@pytest.mark.parametrize(
    "payload,metrics,reason",
    [
        (None, {"num-examples": 10}, "no 'fedge.update'"),
        (b"FDGE" + bytes(40), {"num-examples": 10}, "format version"),
        ("good-truncated", {"num-examples": 10}, "truncated|length"),
        ("good", None, "no 'metrics'"),
        ("good", {"num-examples": 0}, "positive integer"),
        ("good", {"num-examples": 1.5}, "positive integer"),
        ("good", {"num-examples": 3, "train-loss": float("nan")}, "finite"),
        ("fp16", {"num-examples": 3}, "encoded with codec 'fp16'"),
    ],
)
def test_bad_replies_are_rejected_with_a_reason(engine: Engine, step: FedAvgStep, payload, metrics, reason, caplog) -> None:
    good = engine.algorithm.codec.encode(torch.randn(N))
    payload = {"good": good, "good-truncated": good[:100], "fp16": make_codec("fp16").encode(torch.randn(N))}.get(
        payload, payload
    )
    failure = _take(engine, step, _Reply(_content(payload, metrics), 42))
    assert failure is not None and failure.node == 42 and failure.kind == "invalid", failure
    assert re.search(reason, failure.reason), failure.reason
    assert step.aggregate.count == 0  # nothing reached the accumulator
    assert "rejected update from node 42" in caplog.text


def test_malicious_input_at_the_door(engine: Engine, step: FedAvgStep, caplog) -> None:
    """Each hostile shape of a reply is refused with a logged reason before any decoding; a good
    reply from another node in the same round is still used."""
    good = engine.algorithm.codec.encode(torch.randn(N))
    ok = {"num-examples": 10, "train-loss": 0.5}
    smuggled = _content(good, ok)
    smuggled["state"] = ArrayRecord({"x": Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=bytes(4))})
    huge = _content(good + bytes(4 << 20), ok)  # 4 MiB more: far past any legitimate reply
    float_update = _content(None, ok)
    float_update[UPDATE_RECORD] = ArrayRecord({PAYLOAD_KEY: Array(dtype="float32", shape=(len(good) // 4,),
                                                                   stype=PAYLOAD_STYPE, data=good[: len(good) // 4 * 4])})
    wrong_shape = _content(None, ok)
    wrong_shape[UPDATE_RECORD] = ArrayRecord({PAYLOAD_KEY: Array(dtype="uint8", shape=(3, len(good)),
                                                                  stype=PAYLOAD_STYPE, data=good)})
    cases = {
        "unknown record names": smuggled,
        "oversized reply": huge,
        "expected a fedge.payload/1 uint8 array": float_update,
        "declares shape": wrong_shape,
        "not a finite number": _content(good, {**ok, "seconds": float("inf")}),
        "positive integer": _content(good, {"num-examples": -5}),
        "metric 'train-loss' is not a finite number": _content(good, {"num-examples": 3, "train-loss": float("nan")}),
    }
    for expected, content in cases.items():
        failure = _take(engine, step, _Reply(content, 42))
        assert failure is not None and failure.node == 42 and expected in failure.reason, (expected, failure)
    assert step.aggregate.count == 0
    assert _take(engine, step, _Reply(_content(good, ok), 7)) is None  # the round goes on
    assert step.aggregate.count == 1
    assert caplog.text.count("rejected update from node 42") == len(cases)


def test_client_error_reply_is_recorded(engine: Engine, step: FedAvgStep) -> None:
    failure = _take(engine, step, _Reply(RecordDict(), 7, _Error(3, "boom")))
    assert failure is not None and (failure.node, failure.kind, failure.reason) == (7, "client-error", "client error 3: boom")


def test_reply_type_is_the_algorithms_own() -> None:
    assert Reply(1, RecordDict()).node == 1
