"""Secure aggregation on real processes (Flower's simulation engine): one device in five crashes in
every round after dealing its shares (a 20% mid-round dropout) and every round still finishes with
the exact sum of the other four. The deployment engine runs the same ClientApp; the accuracy
against the same quantizer without masking is measured by bench/secure_aggregation.py."""

from __future__ import annotations

import pytest

from fedge.server.local import launch
from fedge.server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.mark.slow  # the default suite: the same recovery in-process, and secure rounds on real processes over TLS below
def test_secure_aggregation_survives_a_fifth_of_the_devices_dropping(tmp_path, assert_no_leftovers) -> None:
    settings = RunSettings(rounds=2, clients_per_round=5, local_epochs=3, run_dir=str(tmp_path / "run"),
                           secure_aggregation="secagg:bits=8,clip=0.2,weight-cap=256",
                           faulty_clients="fraction=0.2,fault=crash")
    result = launch(settings, engine="simulation", num_supernodes=5, timeout=400)
    assert_no_leftovers(result.run_dir / "flwr-home")
    assert [row["round"] for row in result.rows] == [1, 2]
    for row in result.rows:
        assert row["clients_used"] == 4 and row["clients_failed"] == 1, row["rejected"]
        assert "crashed" in row["rejected"][0]["reason"]
        assert row["secure_aggregation"].startswith("secagg:bits=8") and row["secagg_ring_bits"] == 11
    assert result.summary["final_accuracy"] > result.summary["initial_accuracy"] + 0.2


@pytest.mark.slow
def test_secure_aggregation_on_the_deployment_engine(tmp_path, assert_no_leftovers) -> None:
    """The key-exchange stages through a real SuperLink to three SuperNodes (train messages with the secagg record)."""
    settings = RunSettings(rounds=2, clients_per_round=3, min_replies=3, local_epochs=2, run_dir=str(tmp_path / "run"),
                           secure_aggregation="secagg:bits=8,clip=0.2,weight-cap=256", round_timeout=240,
                           wait_for_nodes=120)
    result = launch(settings, engine="deployment", num_supernodes=3, timeout=500)
    assert_no_leftovers(result.run_dir / "flwr-home")
    assert [row["round"] for row in result.rows] == [1, 2]
    assert all(row["clients_used"] == 3 and not row["rejected"] for row in result.rows)
    assert result.summary["final_accuracy"] > result.summary["initial_accuracy"]


def test_over_tls_identities_are_issued_and_a_device_the_operator_did_not_issue_is_refused(
        tmp_path, assert_no_leftovers) -> None:
    """Real SuperLink and SuperNodes over TLS with node authentication: every device's
    secure-aggregation identity is bound to its node key and endorsed by the federation's CA
    (``issuer=`` is set by the launcher), and the consistency round runs. SuperNode 3 presents an
    endorsement from another CA (its node key is registered, so Flower lets it in): the coordinator
    refuses its identity and the other four devices' sum is unmasked. (Five devices: against a
    coordinator that may lie the threshold is above two thirds of the neighbours, t = 3 of 4, so a
    round of four could not lose one.)"""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    from fedge.deploy.certs import init_ca
    from fedge.launcher.federation import LoopbackSecurity
    from fedge.privacy.credentials import endorse, load_node_key

    run = tmp_path / "run"
    security = LoopbackSecurity.create(run / "tls", 5)
    init_ca(tmp_path / "rogue-ca")
    rogue_ca = load_pem_private_key((tmp_path / "rogue-ca" / "ca.key").read_bytes(), None)
    rogue = tmp_path / "node-3.endorsement"  # node 3's own key, endorsed by another CA
    rogue.write_bytes(endorse(rogue_ca, "node-3", load_node_key(security.node_key(3)).public_key()))
    settings = RunSettings(rounds=1, clients_per_round=5, min_replies=4, local_epochs=1, run_dir=str(run),
                           secure_aggregation="secagg:bits=8,clip=0.2,weight-cap=256", round_timeout=240,
                           wait_for_nodes=120)
    result = launch(settings, engine="deployment", num_supernodes=5, tls=True, timeout=400,
                    node_config={3: {"secagg-endorsement": str(rogue)}})
    assert_no_leftovers(result.run_dir / "flwr-home")
    (row,) = result.rows
    assert row["secagg_consistency"] is True and "issuer=" in row["secure_aggregation"]
    assert row["clients_used"] == 4, row["rejected"]
    assert len(row["rejected"]) == 1 and "not endorsed by the operator's CA" in row["rejected"][0]["reason"]
    # the launcher drew the partitions before the nodes started, so the devices' warm process
    # preloads what training needs and no partitioners (scikit-learn, datasets: 130 MiB in it and
    # in every message process it forks)
    from fedge.edge_client.warm_executor import PRELOAD

    assert f"warm: {len(PRELOAD)} module(s) imported" in result.logs["warm-executor"].read_text()
