"""The deployment engine for real: flower-superlink + flower-supernode processes on 127.0.0.1."""

from __future__ import annotations

import pytest

from server.engines import launch
from server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_superlink_and_two_supernodes_train_two_rounds(tmp_path, assert_no_leftovers) -> None:
    settings = RunSettings(rounds=2, clients_per_round=2, min_replies=2, run_dir=str(tmp_path / "run"),
                           round_timeout=240, wait_for_nodes=120, export_bundle="auto")
    result = launch(settings, engine="deployment", num_supernodes=2, timeout=400)

    assert [row["round"] for row in result.rows] == [1, 2]
    assert all(row["clients_used"] == 2 and row["clients_failed"] == 0 for row in result.rows)
    summary = result.summary
    assert summary is not None
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.3
    assert result.rows[1]["accuracy"] >= result.rows[0]["accuracy"]
    # uplink is the real payload size: 2 clients x 2 rounds x the 4-bit QSGD wire size
    from compression import make_codec

    assert summary["uplink_bytes"] == 4 * make_codec(settings.codec).wire_bytes(38_282)
    assert (result.run_dir / "model.pt").exists() and (result.run_dir / "plot.png").exists()
    # Closing the loop: the coordinator signed the final model; a device verifies and runs it.
    from edge_client.inference import EdgeModel

    bundle = summary["bundle"]
    device = EdgeModel.load(bundle["path"], [bundle["public_key"]], state=tmp_path / "device.json")
    assert device.metadata["round"] == 2 and device.metadata["task"] == "digits"
    assert abs(device.metadata["accuracy"]["fp32"] - summary["final_accuracy"]) < 0.01
    assert_no_leftovers(result.run_dir / "flwr-home")


def test_coordinator_survives_a_corrupt_and_a_silent_client(tmp_path, assert_no_leftovers) -> None:
    """Node 1 corrupts its update, node 2 never answers: the round closes at the timeout with node 0."""
    settings = RunSettings(rounds=1, clients_per_round=3, min_replies=1, run_dir=str(tmp_path / "run"),
                           round_timeout=60, wait_for_nodes=120)
    result = launch(settings, engine="deployment", num_supernodes=3, node_faults={1: "bitflip", 2: "hang"},
                    timeout=400)

    (row,) = result.rows
    assert row["clients_used"] == 1 and row["clients_failed"] == 2
    reasons = sorted(r["reason"] for r in row["rejected"])
    assert reasons[0].startswith("checksum mismatch") and reasons[1] == "no reply within 60 s"
    assert row["accuracy"] > result.summary["initial_accuracy"]
    server_log = (result.run_dir / "logs" / "flwr-run.log").read_text()
    assert "rejected update from node" in server_log and "checksum mismatch" in server_log
    assert_no_leftovers(result.run_dir / "flwr-home")
