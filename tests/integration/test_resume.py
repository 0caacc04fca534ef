"""Crash and resume: every Flower process is SIGKILLed after round k, then the run is restarted."""

from __future__ import annotations

import pytest

from fedge.server.run.checkpoint import CheckpointStore
from fedge.server.local import launch
from fedge.server.settings import RunSettings

# In `make test-slow` only (time budget of the default suite): FedAvg's crash and resume run in the
# default suite on the deployment engine (the coordinator power cut of test_serve.py), client
# evaluation and the compressed downlink on the engine's stand-in Grid (tests/server/test_engine.py).
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]


def test_killed_coordinator_resumes_to_the_same_number_of_rounds(tmp_path, assert_no_leftovers) -> None:
    settings = RunSettings(rounds=4, clients_per_round=4, local_epochs=2, evaluate="both", evaluate_every=2,
                           downlink_codec="lattice:ratio=0.05", run_dir=str(tmp_path / "run"))

    crashed = launch(settings, engine="simulation", num_supernodes=4, stop_after_round=2, timeout=300)
    assert crashed.summary is None  # the run did not finish
    assert_no_leftovers(crashed.run_dir / "flwr-home")
    store = CheckpointStore(crashed.run_dir / "checkpoint")
    saved = store.load()
    assert saved is not None and saved.round in (1, 2, 3)
    assert not list(store.directory.glob("*.tmp"))

    resumed = launch(settings, engine="simulation", num_supernodes=4, timeout=300)
    assert [row["round"] for row in resumed.rows] == [1, 2, 3, 4]
    assert resumed.summary["rounds"] == 4
    assert resumed.summary["resumed_from_round"] == saved.round
    final = CheckpointStore(resumed.run_dir / "checkpoint").load()
    assert final.round == 4
    # 4 short rounds from a random start: the run must learn (the exact level depends on the init)
    assert resumed.summary["final_accuracy"] > resumed.summary["initial_accuracy"] + 0.25
    # federated evaluation by the clients' evaluate handler, every 2 rounds
    assert resumed.rows[3]["federated_replies"] == 4 and 0.3 < resumed.rows[3]["federated_accuracy"] <= 1.0
    assert "federated_accuracy" not in resumed.rows[2]
    # lattice downlink: the first round after each start sends snapshots (a restart is a new Flower
    # run: the devices' copies are gone), the others each version's change
    for row in resumed.rows:
        kind = "downlink_snapshot" if row["round"] in (1, saved.round + 1) else "downlink_current"
        assert row[kind] == 4, row
    assert_no_leftovers(resumed.run_dir / "flwr-home")
