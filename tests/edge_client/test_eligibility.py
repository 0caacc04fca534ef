"""The device's participation policy: conditions read from (a stand-in) sysfs, budgets from its
ledger, and the typed refusal a message gets when the device may not train."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedge.edge_client import eligibility
from fedge.edge_client.eligibility import Policy
from fedge.edge_client.layers import refusal_mod
from fedge.edge_client.resources import LEDGER
from fedge.protocol.refusals import (
    BadConfigRefusal,
    NotEligibleRefusal,
    OverBudgetRefusal,
    read_refusal,
)


def _supply(root: Path, name: str, **files: str) -> None:
    (root / name).mkdir(parents=True)
    for key, value in files.items():
        (root / name / key).write_text(value + "\n")


def test_charging_reads_power_supplies(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FEDGE_POWER_SUPPLY_DIR", str(tmp_path))
    assert eligibility.is_charging() == (True, "no battery (mains powered)")
    _supply(tmp_path, "BAT0", type="Battery", status="Discharging")
    assert eligibility.is_charging()[0] is False
    _supply(tmp_path, "AC", type="Mains", online="0")
    assert eligibility.is_charging()[0] is False
    (tmp_path / "AC" / "online").write_text("1\n")
    assert eligibility.is_charging() == (True, "AC online")
    (tmp_path / "AC" / "online").write_text("0\n")
    (tmp_path / "BAT0" / "status").write_text("Full\n")
    assert eligibility.is_charging()[0] is True


def test_unmetered_refuses_a_cellular_default_route(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(eligibility, "_default_route_interface", lambda: "wwan0")
    assert eligibility.is_unmetered()[0] is False
    monkeypatch.setenv("FEDGE_NET_DIR", str(tmp_path))
    monkeypatch.setattr(eligibility, "_default_route_interface", lambda: "usb0")
    (tmp_path / "usb0").mkdir()
    (tmp_path / "usb0" / "uevent").write_text("INTERFACE=usb0\nDEVTYPE=wwan\n")
    assert eligibility.is_unmetered() == (False, "usb0 is a cellular modem")
    monkeypatch.setattr(eligibility.shutil, "which", lambda name: None)
    (tmp_path / "usb0" / "uevent").write_text("INTERFACE=usb0\n")
    assert eligibility.is_unmetered() == (True, "usb0")
    monkeypatch.setattr(eligibility, "_default_route_interface", lambda: None)
    assert eligibility.is_unmetered()[0] is False


def test_idle_compares_the_load_per_core(monkeypatch) -> None:
    monkeypatch.setattr(eligibility.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    monkeypatch.setattr(eligibility.os, "cpu_count", lambda: 2)
    assert eligibility.is_idle(0.5)[0] is False and eligibility.is_idle(2.0)[0] is True


def test_the_policy_is_validated() -> None:
    with pytest.raises(BadConfigRefusal, match="unknown condition"):
        Policy.from_node_config({"when": "charging,sunny"})
    with pytest.raises(BadConfigRefusal, match="state-dir"):
        Policy.from_node_config({"max-rounds-per-day": 3})
    with pytest.raises(BadConfigRefusal, match="positive"):
        Policy.from_node_config({"max-mb-per-day": "-1", "state-dir": "/x"})
    assert Policy.from_node_config({}) == Policy()


def _ledger(state: Path, *entries: dict) -> None:
    with open(state / LEDGER, "a") as handle:
        for entry in entries:
            handle.write(json.dumps({"time": time.time(), "run": 1, "cpu": 0.2, "wall": 1.0, "bytes_down": 0,
                                     "bytes_up": 0, "peak_rss_mib": 1.0, **entry}) + "\n")


def test_budgets_count_todays_rounds_and_megabytes(tmp_path: Path) -> None:
    policy = Policy.from_node_config({"max-rounds-per-day": 2, "max-mb-per-day": 5, "state-dir": str(tmp_path)})
    policy.check()
    _ledger(tmp_path, {"type": "train", "outcome": "done", "bytes_down": 1e6},
            {"type": "evaluate", "outcome": "done"}, {"type": "train", "outcome": "refused"},
            {"type": "train", "outcome": "done", "time": time.time() - 3 * 86_400})  # another day
    policy.check()  # one round today
    _ledger(tmp_path, {"type": "train", "outcome": "done"})
    with pytest.raises(OverBudgetRefusal, match="2 rounds today"):
        policy.check()
    mb_only = Policy.from_node_config({"max-mb-per-day": 5, "state-dir": str(tmp_path)})
    mb_only.check()
    _ledger(tmp_path, {"type": "evaluate", "outcome": "done", "bytes_up": 4.5e6})
    with pytest.raises(OverBudgetRefusal, match="MB today"):
        mb_only.check()


def test_a_train_message_outside_the_conditions_gets_a_typed_refusal(tmp_path: Path, monkeypatch) -> None:
    _supply(tmp_path, "BAT0", type="Battery", status="Discharging")
    monkeypatch.setenv("FEDGE_POWER_SUPPLY_DIR", str(tmp_path))
    context = Context(run_id=1, node_id=1, node_config={"when": "charging"}, state=RecordDict(), run_config={})
    trained = []

    def handler(msg: Message, ctx: Context) -> Message:
        trained.append(msg)
        return Message(RecordDict(), reply_to=msg)

    def call(message_type: str, stage: str | None = None) -> Message:
        content = RecordDict({"config": ConfigRecord({}), **({"secagg": ConfigRecord({"stage": stage})} if stage else {})})
        msg = Message(content, dst_node_id=1, message_type=message_type)
        msg.metadata.__dict__["_message_id"] = msg.object_id
        return refusal_mod(msg, context, lambda m, c: eligibility.eligibility_mod(m, c, handler))

    reply = call("train.gossip")
    assert read_refusal(reply.content)[0] == NotEligibleRefusal.kind and not trained
    call("train", stage="unmask")  # a stage of a round it already joined is answered
    assert len(trained) == 1
    reply = call("train", stage="masked")  # the masked round trains: the owner's conditions hold for it
    assert read_refusal(reply.content)[0] == NotEligibleRefusal.kind
    assert len(trained) == 1
