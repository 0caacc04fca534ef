"""One registration per algorithm: the server class (found in ``fedge.server.algorithms`` by its
``name``), its settings rules (``settings_used``) and its device handler (a module of
``fedge.edge_client.algorithms``) are declared once, in the algorithm's own files."""

from __future__ import annotations

import pytest
import torch

from fedge.edge_client.app import handled_algorithms
from fedge.server.algorithms import algorithms
from fedge.server.algorithms.registry import _discover, available_algorithms, check_algorithm_settings
from fedge.server.settings import ALGORITHM_KEYS, RunSettings, SettingsError


def test_every_algorithm_in_the_package_is_found() -> None:
    # the package's own (a plugin another test of this process loaded registers beside them)
    assert set(_discover()) == {"fedavg", "fednova", "easgd", "gossip", "fedbuff", "fedasync", "scaffold"}
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


def test_a_plugin_algorithms_messages_name_its_device_handler(tmp_path, monkeypatch) -> None:
    """``register_algorithm(cls, train)``: the algorithm's train messages go to ``train.plugin``
    with the handler's name in their config record, written by the algorithm's own round config
    (``Algorithm.round_config``), not by the engine afterwards."""
    from fedge.protocol import CONFIG_RECORD
    from fedge.protocol.config_keys import PLUGIN_HANDLER
    from fedge.protocol.plugins import PLUGIN_ACTION, _HANDLERS
    from fedge.server.algorithms import registry
    from fedge.server.algorithms.fedavg import FedAvg
    from fedge.coordinator.step import Step
    from tests.server.engines import build_engine

    class Renamed(FedAvg):
        name = "renamed_fedavg_test"

        @property
        def spec(self) -> str:
            return self.name

    monkeypatch.setattr(registry, "_PLUGINS", {})
    monkeypatch.setattr("fedge.protocol.plugins._HANDLERS", dict(_HANDLERS))
    registry.register_algorithm(Renamed, lambda msg, context: msg)
    engine = build_engine({"algorithm": "renamed_fedavg_test", "clients_per_round": 2, "run_dir": str(tmp_path)})
    engine.algorithm.start(torch.zeros(engine.ctx.numel))
    outgoing = engine.algorithm.configure(Step(1, [3, 5]), [3, 5])
    assert [o.message_type for o in outgoing] == [f"train.{PLUGIN_ACTION}"] * 2
    assert {o.content.config_records[CONFIG_RECORD][PLUGIN_HANDLER] for o in outgoing} == {"renamed_fedavg_test"}
    plain = build_engine({"clients_per_round": 2, "run_dir": str(tmp_path / "plain")}).algorithm
    plain.start(torch.zeros(plain.ctx.numel))
    assert all(PLUGIN_HANDLER not in o.content.config_records[CONFIG_RECORD] for o in plain.configure(Step(1, [3]), [3]))
