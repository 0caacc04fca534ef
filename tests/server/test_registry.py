"""One registration per algorithm: the server class (found in ``fedge.server.algorithms`` by its
``name``), its settings rules (``settings_used``) and its device handler (a module of
``fedge.edge_client.algorithms``) are declared once, in the algorithm's own files."""

from __future__ import annotations

import pytest

from fedge.edge_client.app import handled_algorithms
from fedge.server.algorithms import algorithms
from fedge.server.algorithms.registry import _discover, available_algorithms, check_algorithm_settings
from fedge.server.settings import ALGORITHM_KEYS, RunSettings, SettingsError


def test_every_algorithm_in_the_package_is_found() -> None:
    # the package's own (a plugin another test of this process loaded registers beside them)
    assert set(_discover()) == {"fedavg", "easgd", "gossip", "fedbuff", "fedasync"}
    assert set(_discover()) <= set(algorithms())


def test_every_algorithm_has_a_device_handler() -> None:
    for name, cls in algorithms().items():
        assert (cls.device_handler or name) in handled_algorithms, name


def test_settings_rules_come_from_the_classes() -> None:
    for name, cls in algorithms().items():
        assert cls.settings_used <= set(ALGORITHM_KEYS), name
    with pytest.raises(SettingsError, match=f"unknown algorithm 'ring'; available: {', '.join(available_algorithms())}$"):
        check_algorithm_settings(RunSettings(algorithm="ring"))
    with pytest.raises(SettingsError, match="downlink-codec=.lattice. applies to algorithm"):
        check_algorithm_settings(RunSettings(algorithm="gossip", downlink_codec="lattice"))
    assert check_algorithm_settings(RunSettings(algorithm="fedbuff", aggregator="median")).name == "fedbuff"
