"""The device's resource report: its CPU figure against /proc, its bytes against Flower's own
serialization, the phases apart, the coordinator's reading (validated) and summary."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedge.edge_client import resources
from fedge.protocol.resources import RESOURCES_RECORD, ResourceReport, read_report
from fedge.coordinator.tally import resource_summary


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    x = 0
    while time.process_time() < end:
        x += 1


def _message() -> Message:
    msg = Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=1, message_type="train")
    # a message as it arrives: with the metadata the SuperNode gives it
    msg.metadata.__dict__["_message_id"] = msg.object_id
    return msg


def _context(node_config: dict | None = None) -> Context:
    return Context(run_id=1, node_id=1, node_config=node_config or {}, state=RecordDict(), run_config={})


def _handler(msg: Message, context: Context) -> Message:
    with resources.phase("train"):
        _burn(0.4)
    with resources.phase("encode"):
        _burn(0.1)
    _burn(0.05)
    return Message(RecordDict({"metrics": MetricRecord({"loss": 1.0})}), reply_to=msg)


def _proc_cpu() -> float:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_in_a_forked_child_the_reported_cpu_agrees_with_proc_within_ten_percent() -> None:
    """As in a warm device: a child forked from a process that has already run messages; its
    report counts this process's CPU since the fork, which /proc counts too."""
    resources.resource_mod(_message(), _context(), _handler)  # the parent has run one
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            _burn(0.2)  # "startup": what the process did before the message reached the ClientApp
            reply = resources.resource_mod(_message(), _context(), _handler)
            proc = _proc_cpu()
            report = read_report(reply.content)
            os.write(write, json.dumps({"report": report.__dict__ if report else None, "proc": proc}).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.waitpid(pid, 0)
    got = json.loads(data)
    report, proc = got["report"], got["proc"]
    assert report is not None
    assert abs(report["cpu_seconds"] - proc) <= 0.1 * proc, (report, proc)
    assert report["startup_cpu_seconds"] == pytest.approx(0.2, abs=0.08)
    assert report["train_cpu_seconds"] == pytest.approx(0.4, abs=0.05)
    assert report["encode_cpu_seconds"] == pytest.approx(0.1, abs=0.05)
    assert report["overhead_cpu_seconds"] == pytest.approx(
        report["cpu_seconds"] - report["train_cpu_seconds"] - report["encode_cpu_seconds"])


def test_bytes_are_flowers_serialized_message_and_reply_report_included() -> None:
    msg = _message()
    reply = resources.resource_mod(msg, _context(), _handler)
    report = read_report(reply.content)
    assert report is not None
    assert report.bytes_down == resources.message_bytes(msg)
    assert report.bytes_up == resources.message_bytes(reply)  # with the report in place
    assert report.peak_rss_mib > 10 and report.wall_seconds > 0


def test_a_device_can_leave_the_report_out_and_keeps_its_own_ledger(tmp_path: Path) -> None:
    context = _context({"resource-report": "false", "state-dir": str(tmp_path)})
    reply = resources.resource_mod(_message(), context, _handler)
    assert RESOURCES_RECORD not in reply.content
    (entry,) = [json.loads(line) for line in (tmp_path / resources.LEDGER).read_text().splitlines()]
    assert entry["outcome"] == "done" and entry["cpu"] > 0.5 and entry["bytes_up"] == resources.message_bytes(reply)


def _report(**values: float) -> ResourceReport:
    base = dict(cpu_seconds=1.0, train_cpu_seconds=0.5, encode_cpu_seconds=0.1, overhead_cpu_seconds=0.4,
                startup_cpu_seconds=0.1, wall_seconds=2.0, peak_rss_mib=300.0, bytes_down=1e5, bytes_up=2e4)
    return ResourceReport(**{**base, **values})


@pytest.mark.parametrize("bad", [{"cpu-seconds": -1.0}, {"wall-seconds": float("nan")}, {"bytes-up": float("inf")},
                                 {"peak-rss-mib": 1e12}, {"cpu-seconds": None}])
def test_a_malformed_report_is_ignored_not_trusted(bad: dict) -> None:
    record = dict(_report().record())
    for key, value in bad.items():
        if value is None:
            del record[key]
        else:
            record[key] = value
    assert read_report(RecordDict({RESOURCES_RECORD: MetricRecord(record)})) is None
    assert read_report(RecordDict({RESOURCES_RECORD: _report().record()})) == _report()


def test_the_row_summary_is_the_median_and_the_95th_percentile_over_devices() -> None:
    reports = [_report(cpu_seconds=float(v)) for v in range(1, 21)]  # 1..20
    summary = resource_summary(reports)
    assert summary["devices"] == 20
    assert summary["cpu_seconds"] == {"median": 10.5, "p95": 19.0}
    assert resource_summary([]) == {}


def test_a_secure_rounds_exchanges_are_messages_not_rounds_in_the_ledger(tmp_path: Path) -> None:
    """Secure aggregation's stages are train messages too (Flower's SecAgg+ convention); a daily
    round budget counts the round the device trained in, not each of its exchanges."""
    context = _context({"resource-report": "false", "state-dir": str(tmp_path)})
    for stage in ("advertise", "share", "masked", "unmask"):
        msg = _message()
        msg.content["secagg"] = ConfigRecord({"stage": stage})
        resources.resource_mod(msg, context, lambda m, c: Message(RecordDict(), reply_to=m))
    totals = resources.day_totals(tmp_path)
    assert totals["messages"] == 4 and totals["rounds"] == 1
