"""The coordinator's per-reply validation, driven with real Flower records.

Only the Message envelope is stood in for (a real Message needs a running app's run id); the
content is made of real ``flwr.app`` records exactly as the edge client builds them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from compression.protocol import METRICS_RECORD, PAYLOAD_KEY, PAYLOAD_STYPE, UPDATE_RECORD
from server.fedavg import FedAvgLoop, _RoundTally
from server.run_directory import RunDirectory
from server.settings import RunSettings
from aggregation import StreamingMean
from tasks import make_task

N = 38_282


def _reply(payload: bytes | None, metrics: dict | None, node: int = 7, error=None):
    content = RecordDict()
    if payload is not None:
        content[UPDATE_RECORD] = ArrayRecord(
            {PAYLOAD_KEY: Array(dtype="uint8", shape=(len(payload),), stype=PAYLOAD_STYPE, data=payload)}
        )
    if metrics is not None:
        content[METRICS_RECORD] = MetricRecord(metrics)
    return SimpleNamespace(
        metadata=SimpleNamespace(src_node_id=node),
        has_error=lambda: error is not None,
        error=error,
        content=content,
    )


@pytest.fixture
def loop(tmp_path) -> FedAvgLoop:
    settings = RunSettings(run_dir=str(tmp_path))
    return FedAvgLoop(settings, make_task("digits"), RunDirectory(tmp_path))


def test_valid_reply_is_accumulated(loop: FedAvgLoop) -> None:
    tally = _RoundTally(mean=StreamingMean(N))
    payload = loop.codec.encode(torch.randn(N))
    loop._absorb(_reply(payload, {"num-examples": 10, "train-loss": 0.5}), tally, 1)
    assert tally.used == 1 and tally.uplink_bytes == len(payload) and not tally.rejected


@pytest.mark.parametrize(
    "payload,metrics,reason",
    [
        (None, {"num-examples": 10}, "no 'update'"),
        (b"FDGE" + bytes(40), {"num-examples": 10}, "format version"),
        ("good-truncated", {"num-examples": 10}, "truncated|length"),
        ("good", None, "no 'metrics'"),
        ("good", {"num-examples": 0}, "positive integer"),
        ("good", {"num-examples": 1.5}, "positive integer"),
        ("good", {"num-examples": 3, "train-loss": float("nan")}, "finite"),
        ("fp16", {"num-examples": 3}, "encoded with codec 'fp16'"),
    ],
)
def test_bad_replies_are_rejected_with_a_reason(loop: FedAvgLoop, payload, metrics, reason, caplog) -> None:
    from compression import make_codec

    good = loop.codec.encode(torch.randn(N))
    payload = {"good": good, "good-truncated": good[:100], "fp16": make_codec("fp16").encode(torch.randn(N))}.get(
        payload, payload
    )
    tally = _RoundTally(mean=StreamingMean(N))
    loop._absorb(_reply(payload, metrics, node=42), tally, 3)
    assert tally.used == 0 and tally.mean.count == 0
    (rejected,) = tally.rejected
    assert rejected["node"] == 42
    import re

    assert re.search(reason, rejected["reason"]), rejected["reason"]
    assert "rejected update from node 42" in caplog.text


def test_client_error_reply_is_recorded(loop: FedAvgLoop) -> None:
    tally = _RoundTally(mean=StreamingMean(N))
    loop._absorb(_reply(None, None, error=SimpleNamespace(code=3, reason="boom")), tally, 1)
    assert tally.rejected == [{"node": 7, "reason": "client error 3: boom"}]
