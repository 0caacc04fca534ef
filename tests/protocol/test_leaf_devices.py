"""A simulated leaf's node numbering mapped onto the federation's devices (``leaf-devices``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedge.protocol.leaf_devices import LeafDevicesError, parse_leaf_devices
from fedge.server.settings import RunSettings, SettingsError


@given(st.integers(1, 12), st.integers(0, 40))
def test_the_leaves_nodes_are_every_device_once(leaves: int, extra: int) -> None:
    """Over all L leaves the simulated nodes map onto the N devices one to one, each leaf holding
    the partitions a deployed leaf's SuperNodes hold (I, I + L, ...)."""
    devices = leaves + extra
    seen = []
    for index in range(leaves):
        leaf = parse_leaf_devices(f"{index}/{leaves}/{devices}")
        mapped = [leaf.device(j) for j in range(leaf.nodes)]
        assert mapped == list(range(index, devices, leaves))
        seen += mapped
    assert sorted(seen) == list(range(devices))


@pytest.mark.parametrize(("spec", "error"), [
    ("1/2", "must be 'I/L/N'"), ("a/2/4", "must be 'I/L/N'"), ("-1/2/4", "must be 'I/L/N'"),
    ("2/2/4", "not one of 0..1"), ("0/5/4", "cannot fill 5 leaves"), ("0/0/4", "not one of"),
])
def test_a_malformed_mapping_is_refused_with_why(spec: str, error: str) -> None:
    with pytest.raises(LeafDevicesError, match=error):
        parse_leaf_devices(spec)
    with pytest.raises(SettingsError, match=error):  # before any process starts
        RunSettings(leaf_devices=spec)


def test_a_node_beyond_the_leaf_is_refused() -> None:
    leaf = parse_leaf_devices("1/2/5")  # partitions 1 and 3
    assert leaf.nodes == 2 and leaf.spec == "1/2/5"
    with pytest.raises(LeafDevicesError, match="has no node 2"):
        leaf.device(2)
