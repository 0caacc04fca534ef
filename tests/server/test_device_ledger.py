"""``devices.json`` (``fedge.server.run.device_ledger``): each device as the coordinator saw it, step
by step, and a resumed run goes on from the file."""

from __future__ import annotations

import json
from pathlib import Path

from fedge.protocol.failures import Failure, FailureKind
from fedge.protocol.resources import ResourceReport
from fedge.coordinator.tally import Tally
from fedge.server.run.device_ledger import DeviceLedger


def _report(cpu: float) -> ResourceReport:
    return ResourceReport(cpu, cpu, 0.0, 0.0, 0.0, 1.0, 200.0, 10.0, 20.0)


def test_the_ledger_counts_rounds_refusals_and_declines_per_device_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "devices.json"
    ticks = iter([100.0, 200.0, 300.0])
    ledger = DeviceLedger(path, clock=lambda: next(ticks))
    names = {7: 0, 8: 1, 9: 2}.get
    one = Tally(0.0, members=[7, 8], reports={7: _report(1.0), 8: _report(2.0)})
    one.failed(Failure(9, FailureKind.TIMEOUT, "no reply"))
    ledger.record(1, [7, 8, 9], one, names)
    two = Tally(0.0, members=[7], reports={7: _report(3.0), 9: _report(4.0)})
    two.failed(Failure(9, FailureKind.INVALID, "not finite"))
    two.failed(Failure(8, FailureKind.NOT_ELIGIBLE, "on battery"))
    ledger.record(2, [7, 8, 9], two, names)
    devices = json.loads(path.read_text())["devices"]
    assert devices["7"] == {"node": 7, "partition": 0, "rounds": 2, "last_asked": 2, "last_round": 2, "last_seen": 200.0,
                            "resources": {**_report(3.0).__dict__}}
    assert devices["8"]["rounds"] == 1 and devices["8"]["last_round"] == 1 and devices["8"]["declined"] == {"not-eligible": 1}
    assert devices["9"]["rounds"] == 0 and devices["9"]["refusals"] == {"timeout": 1, "invalid": 1}
    assert devices["9"]["last_round"] == 2  # it answered (its reply was refused): it is there
    resumed = DeviceLedger(path, clock=lambda: 400.0)
    resumed.record(3, [8], Tally(0.0, members=[8]), names)
    assert json.loads(path.read_text())["devices"]["8"]["rounds"] == 2


def test_an_unreadable_ledger_starts_again(tmp_path: Path) -> None:
    path = tmp_path / "devices.json"
    path.write_text("{not json")
    assert DeviceLedger(path).devices == {}
