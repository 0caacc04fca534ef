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


@pytest.mark.slow  # the default suite has it in tests/integration/test_device_trust.py ("train-in-clear")
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


_LYING_COORDINATOR = '''"""A coordinator that lies (privacy audit 2, N2): it lets one endorsement in twice, as a colluding
device's two SuperNodes would ask. Loaded as a plugin by every process; only the coordinator's
check is replaced, each device keeps its own."""
import fedge.coordinator.secure_round as secure_round

secure_round.check_distinct = lambda credentials: None
'''


@pytest.mark.timeout(600)
def test_devices_refuse_a_coordinator_that_multiplies_one_identity(tmp_path: Path, assert_no_leftovers,
                                                                  monkeypatch) -> None:
    """Privacy audit 2, N2(a), on real processes over TLS with issued identities: SuperNode 4 holds
    SuperNode 0's node key and endorsement (a colluder with two SuperNodes), and the coordinator,
    patched to lie, lets both in. Every device is shown the two participants with one endorsement
    at the share stage and refuses the round: no share is dealt, no train message goes out, so no
    update, example count or metric leaves any device."""
    from fedge.launcher.federation import LoopbackSecurity

    (tmp_path / "lying_coordinator.py").write_text(_LYING_COORDINATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    security = LoopbackSecurity.create(run / "tls", 5)
    settings = RunSettings(rounds=1, clients_per_round=5, min_replies=2, local_epochs=1, run_dir=str(run),
                           secure_aggregation="secagg:bits=8,clip=0.2,weight-cap=256", round_timeout=120,
                           wait_for_nodes=120, plugins="lying_coordinator", export_bundle="")
    result = launch(settings, engine="deployment", num_supernodes=5, tls=True, timeout=500,
                    node_config={4: security.node_identity(0)})
    assert_no_leftovers(result.run_dir / "flwr-home")
    (row,) = result.rows
    # what went up were the stage replies (keys, refusals): no update, no metric, no example count
    assert row["clients_used"] == 0 and row["train_loss"] is None, row
    reasons = [entry["reason"] for entry in row["rejected"]]
    # each device's own check, at the share stage (the coordinator's was patched out)
    assert len(reasons) == 5 and all(r.startswith("share:") and "one endorsement, one participant" in r
                                     for r in reasons), reasons


def test_devices_refuse_a_round_smaller_than_their_minimum(tmp_path: Path, assert_no_leftovers) -> None:
    """Privacy audit 2, N2(b), on real processes: the coordinator plans a two-device secure round
    (the sum minus a colluder's input would be the other's update); both devices' owners pinned
    ``min-participants = 3`` and refuse at the first stage, with a typed ``policy`` refusal, before
    any key, share or update leaves them."""
    settings = RunSettings(rounds=1, clients_per_round=2, min_replies=2, local_epochs=1,
                           run_dir=str(tmp_path / "run"), secure_aggregation="secagg:bits=8,clip=0.2,weight-cap=256",
                           round_timeout=120, wait_for_nodes=120, export_bundle="")
    policy = {"min-participants": 3}
    result = launch(settings, engine="deployment", num_supernodes=2, timeout=300, node_config={0: policy, 1: policy})
    assert_no_leftovers(result.run_dir / "flwr-home")
    (row,) = result.rows
    assert row["clients_used"] == 0 and row["train_loss"] is None, row
    assert len(row["rejected"]) == 2 and all(e["kind"] == "policy" for e in row["rejected"]), row["rejected"]
    assert all("at least 3" in e["reason"] for e in row["rejected"])
