"""The deployment engine for real: flower-superlink + flower-supernode processes on 127.0.0.1."""

from __future__ import annotations

from collections import Counter

import pytest

from fedge.server.local import launch
from fedge.server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


# In `make test-slow` (time budget): the default suite runs the deployment engine through the
# template's `fedge local-cluster --app .` from the wheel (tests/test_packaging.py) and `fedge serve`
# with joined devices, a corrupting one and a power cut (tests/integration/test_serve.py).
@pytest.mark.slow
def test_superlink_and_two_supernodes_with_a_slow_device_train_and_sign_a_bundle(tmp_path, assert_no_leftovers) -> None:
    """The deployment engine end to end, asynchronously and secured: FedBuff (2 versions) on a real
    SuperLink and two SuperNodes over TLS with SuperNode authentication (registered keys), one node
    forty times slower (its own node config ``slowdown=40``: a warm device's message is about 0.1 s
    of work, and ten times that no longer outlasted the fast node's next message through the
    SuperLink), then the signed bundle verified and run as on a device. Refusals (unregistered key, plaintext): ``test_tls.py``. FedAvg: the next test."""
    settings = RunSettings(algorithm="fedbuff:concurrency=2,buffer=1", rounds=2, clients_per_round=2,
                           local_epochs=3, run_dir=str(tmp_path / "run"), round_timeout=240, wait_for_nodes=120,
                           export_bundle="auto")
    result = launch(settings, engine="deployment", num_supernodes=2, node_config={1: {"slowdown": 40}}, timeout=500,
                    tls=True)
    assert_no_leftovers(result.run_dir / "flwr-home")
    assert "Uvicorn running on https://" in result.logs["superlink"].read_text()
    rows = result.rows
    assert [row["round"] for row in rows] == [1, 2]
    assert all(row["algorithm"] == "fedbuff" and row["updates_applied"] == 1 and not row["rejected"] for row in rows)
    # versions do not wait for the slow device: the fast one makes both (a synchronous round would
    # need both nodes every time)
    contributions = Counter(node for row in rows for node in row["nodes"])
    assert sorted(contributions.values()) == [2]
    summary = result.summary
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.2
    # uplink is the real payload size: 2 updates of the 4-bit QSGD wire size
    from fedge.compression import make_codec

    assert summary["uplink_bytes"] == 2 * make_codec(settings.codec).wire_bytes(38_282)
    assert (result.run_dir / "model.pt").exists() and (result.run_dir / "plot.png").exists()
    # Closing the loop: the coordinator signed the final model; a device verifies and runs it.
    from fedge.edge_client.inference import EdgeModel

    bundle = summary["bundle"]
    device = EdgeModel.load(bundle["path"], [bundle["public_key"]], state=tmp_path / "device.json")
    assert device.metadata["round"] == 2 and device.metadata["task"] == "digits"
    assert abs(device.metadata["quality"]["fp32"] - summary["final_accuracy"]) < 0.01


@pytest.mark.slow  # the default suite: test_serve.py (a truncating device, a device killed mid-run)
def test_coordinator_survives_a_corrupt_and_a_silent_client(tmp_path, assert_no_leftovers) -> None:
    """Node 1 corrupts its update, node 2 never answers: the round closes at the timeout with node 0."""
    settings = RunSettings(rounds=1, clients_per_round=3, min_replies=1, local_epochs=1, run_dir=str(tmp_path / "run"),
                           round_timeout=25, wait_for_nodes=120)
    result = launch(settings, engine="deployment", num_supernodes=3,
                    node_config={1: {"fault": "bitflip"}, 2: {"fault": "hang"}},
                    timeout=400)

    (row,) = result.rows
    assert row["clients_used"] == 1 and row["clients_failed"] == 2
    reasons = sorted(r["reason"] for r in row["rejected"])
    assert reasons[0].startswith("checksum mismatch") and reasons[1] == "no reply within 25 s"
    assert row["accuracy"] > result.summary["initial_accuracy"]
    server_log = (result.run_dir / "logs" / "flwr-run.log").read_text()
    assert "rejected update from node" in server_log and "checksum mismatch" in server_log
    assert_no_leftovers(result.run_dir / "flwr-home")
