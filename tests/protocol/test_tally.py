"""The one reply count every driver keeps (``fedge.coordinator.tally.Tally.replied``): what arrived is
counted once, used or refused, before any door decides on it."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict

from fedge.protocol.records import MEASURE_RECORD, UPDATE_RECORD, array_bytes, payload_record
from fedge.protocol.resources import RESOURCES_RECORD, ResourceReport
from fedge.coordinator.tally import Tally, resource_summary


@pytest.fixture(autouse=True)
def _task() -> None:  # what Flower's runtime sets before a Message is built
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def _reply(content: RecordDict) -> Message:
    sent = Message(RecordDict(), dst_node_id=3, message_type="train")
    return Message(content, reply_to=sent)


def test_every_arrived_reply_is_counted_once_with_its_update_and_its_measure_apart() -> None:
    update = RecordDict({UPDATE_RECORD: payload_record(b"x" * 100), MEASURE_RECORD: payload_record(b"m" * 30),
                         "metrics": MetricRecord({"num-examples": 5})})
    model = RecordDict({"arrays": ArrayRecord([np.ones((4, 4), dtype=np.float32)]),
                        "metrics": MetricRecord({"num-examples": 5})})  # a Flower app's node without a codec
    tally = Tally(0.0)
    tally.replied(_reply(update))
    tally.replied(_reply(update))  # a refused one counts the same: its bytes were sent
    tally.replied(_reply(model))
    tally.replied(Message(Error(code=1, reason="boom"), reply_to=Message(RecordDict(), dst_node_id=3,
                                                                           message_type="train")))
    assert tally.uplink == 2 * array_bytes(update, (UPDATE_RECORD,)) + array_bytes(model)
    assert tally.measurement == 2 * array_bytes(update, (MEASURE_RECORD,))
    assert tally.uplink > 2 * 100 and not tally.resources and tally.used == 0  # counting is not using


def test_a_valid_resource_report_is_kept_and_summarised() -> None:
    report = ResourceReport(cpu_seconds=2.0, train_cpu_seconds=1.5, encode_cpu_seconds=0.2, overhead_cpu_seconds=0.3,
                            startup_cpu_seconds=0.1, wall_seconds=3.0, peak_rss_mib=200.0, bytes_down=1e5,
                            bytes_up=2e4)
    tally = Tally(0.0)
    for cpu in (1.0, 2.0, 4.0):
        content = RecordDict({"metrics": MetricRecord({"num-examples": 1})})
        content[RESOURCES_RECORD] = ResourceReport(**{**report.__dict__, "cpu_seconds": cpu}).record()
        tally.replied(_reply(content))
    bad = RecordDict({RESOURCES_RECORD: MetricRecord({"cpu-seconds": float("nan")})})
    tally.replied(_reply(bad))  # malformed: not a report
    summary = resource_summary(tally.resources)
    assert summary["devices"] == 3
    assert summary["cpu_seconds"] == {"median": 2.0, "p95": 4.0}
