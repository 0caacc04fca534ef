"""The faulty-clients setting: which simulated nodes misbehave, and the spec's validation."""

from __future__ import annotations

import pytest
from flwr.app import Context, RecordDict

from fedge.edge_client.faults import fault_of
from fedge.protocol.faulty_clients import parse_faulty_clients
from fedge.server.settings import RunSettings, SettingsError


def _context(partition: int, partitions: int = 10, faulty: str = "none", **node) -> Context:
    return Context(run_id=1, node_id=partition + 1, state=RecordDict(), run_config={"faulty-clients": faulty},
                   node_config={"partition-id": partition, "num-partitions": partitions, **node})


def test_the_last_partitions_misbehave_and_a_node_config_wins() -> None:
    faults = [fault_of(_context(p, faulty="fraction=0.2,fault=signflip")) for p in range(10)]
    assert faults == [""] * 8 + ["signflip"] * 2
    assert [fault_of(_context(p, partitions=16, faulty="fraction=0.2")) for p in range(16)].count("signflip") == 4
    assert fault_of(_context(0)) == ""
    assert fault_of(_context(0, fault="bitflip")) == "bitflip"


@pytest.mark.parametrize("spec", ["fraction=2", "fault=melt", "ratio=0.2", "fraction=x"])
def test_bad_specs_are_refused_before_anything_starts(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_faulty_clients(spec)
    with pytest.raises(SettingsError, match="faulty-clients"):
        RunSettings(faulty_clients=spec)
