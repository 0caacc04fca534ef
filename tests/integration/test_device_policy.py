"""A device's own policy on real processes: a SuperLink and three SuperNodes (warm), one over its
daily round budget after one round, one on battery that trains only when charging. Neither is
trained when it may not be, both are counted as declined (not failed), and the device's ledger,
read by ``fedge-edge status``, has what it spent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedge.server.local import launch
from fedge.server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def test_a_device_over_budget_or_outside_its_conditions_declines_and_is_counted_so(
        tmp_path: Path, monkeypatch, assert_no_leftovers) -> None:
    battery = tmp_path / "power_supply" / "BAT0"
    battery.mkdir(parents=True)
    (battery / "type").write_text("Battery\n")
    (battery / "status").write_text("Discharging\n")
    monkeypatch.setenv("FEDGE_POWER_SUPPLY_DIR", str(battery.parent))  # every node's "sysfs": on battery
    budgeted = tmp_path / "device-0"
    budgeted.mkdir()
    settings = RunSettings(rounds=2, clients_per_round=3, local_epochs=1, run_dir=str(tmp_path / "run"),
                           round_timeout=120, wait_for_nodes=120)
    result = launch(settings, engine="deployment", num_supernodes=3, timeout=300,
                    node_config={0: {"max-rounds-per-day": 1, "state-dir": str(budgeted)}, 1: {"when": "charging"}})
    assert_no_leftovers(result.run_dir / "flwr-home")
    first, second = result.rows
    # round 1: node 0 within budget trains, node 1 on battery declines; round 2: node 0 is over budget
    assert (first["clients_used"], first["clients_declined"], first["clients_failed"]) == (2, 1, 0), first
    assert (second["clients_used"], second["clients_declined"], second["clients_failed"]) == (1, 2, 0), second
    assert first["declined"] == {"not-eligible": 1} and second["declined"] == {"not-eligible": 1, "over-budget": 1}
    # the rows carry the devices' resource reports (every reply: used and declined)
    assert first["device_resources"]["devices"] == 3 and first["device_resources"]["cpu_seconds"]["p95"] > 0
    status = subprocess.run([str(Path(sys.executable).parent / "fedge-edge"), "status", "--state-dir", str(budgeted)],
                            capture_output=True, text=True, check=True, timeout=60)
    today = json.loads(status.stdout)
    assert today["rounds"] == 1 and today["refused"] >= 1 and today["cpu_seconds"] > 0 and today["mb_down"] > 0.1


def test_a_device_that_requires_secure_aggregation_refuses_a_round_without_it(
        tmp_path: Path, assert_no_leftovers) -> None:
    """Privacy audit 2, N1, on real processes: a coordinator runs a round without secure aggregation;
    the two devices whose owners pinned it refuse with a typed ``policy`` refusal, counted as
    failures, and only the third device's update is used."""
    settings = RunSettings(rounds=1, clients_per_round=3, local_epochs=1, run_dir=str(tmp_path / "run"),
                           round_timeout=120, wait_for_nodes=120)
    policy = {"require-secure-aggregation": "true"}
    result = launch(settings, engine="deployment", num_supernodes=3, timeout=300, node_config={0: policy, 1: policy})
    assert_no_leftovers(result.run_dir / "flwr-home")
    (row,) = result.rows
    assert (row["clients_used"], row["clients_failed"], row["clients_declined"]) == (1, 2, 0), row
    assert row["failures"] == {"policy": 2}
    assert all("requires secure aggregation" in entry["reason"] for entry in row["rejected"])
