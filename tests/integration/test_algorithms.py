"""EASGD and gossip on Flower's real engines: a crash and resume on the simulation engine each, and
gossip once on the deployment engine (real SuperLink and SuperNodes on 127.0.0.1)."""

from __future__ import annotations

import pytest

from server.checkpoint import CheckpointStore
from server.engines import launch
from server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.mark.parametrize("algorithm", ["easgd", "gossip:topology=ring"])
def test_killed_run_resumes_to_the_same_number_of_rounds(tmp_path, assert_no_leftovers, algorithm) -> None:
    settings = RunSettings(algorithm=algorithm, rounds=3, clients_per_round=4, local_epochs=5,
                           run_dir=str(tmp_path / "run"))
    crashed = launch(settings, engine="simulation", num_supernodes=4, stop_after_round=1, timeout=300)
    assert crashed.summary is None
    assert_no_leftovers(crashed.run_dir / "flwr-home")
    saved = CheckpointStore(crashed.run_dir / "checkpoint").load()
    assert saved is not None and saved.round >= 1 and saved.algorithm.startswith(algorithm.split(":")[0])

    resumed = launch(settings, engine="simulation", num_supernodes=4, timeout=300)
    assert_no_leftovers(resumed.run_dir / "flwr-home")
    assert [row["round"] for row in resumed.rows] == [1, 2, 3]
    summary = resumed.summary
    assert summary["rounds"] == 3 and summary["resumed_from_round"] == saved.round
    assert CheckpointStore(resumed.run_dir / "checkpoint").load().round == 3
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.1
    last = resumed.rows[-1]
    assert last["algorithm"] == algorithm.split(":")[0] and last["clients_used"] == 4
    if algorithm == "easgd":
        assert last["center_distance"] > 0 and 0 <= last["client_model_accuracy"] <= 1
    else:
        assert last["consensus_distance"] >= 0 and last["nodes_measured"] == 4
        assert last["uplink_bytes"] < last["uplink_fp32_bytes"] / 7  # 4-bit q's, headers included
    assert (resumed.run_dir / "model.pt").exists() and (resumed.run_dir / "algorithm.json").exists()


def test_gossip_on_the_deployment_engine(tmp_path, assert_no_leftovers) -> None:
    settings = RunSettings(algorithm="gossip:topology=ring", rounds=2, clients_per_round=3, min_replies=3,
                           run_dir=str(tmp_path / "run"), round_timeout=240, wait_for_nodes=120)
    result = launch(settings, engine="deployment", num_supernodes=3, timeout=500)
    assert_no_leftovers(result.run_dir / "flwr-home")
    assert [row["round"] for row in result.rows] == [1, 2]
    assert all(row["clients_used"] == 3 and not row["rejected"] for row in result.rows)
    # step 1 sends every node its public copies in full, step 2 only the relayed 4-bit q's
    assert result.rows[1]["downlink_bytes"] < result.rows[0]["downlink_bytes"] / 4
    assert result.summary["final_accuracy"] > result.summary["initial_accuracy"]
