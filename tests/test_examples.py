"""The plugin examples under examples/plugins: a codec with a reserved wire id, an aggregator and
a round algorithm from outside Fedge, each registered by importing its module (all three in one
run on Flower's simulation engine: ``tests/integration/test_plugin_examples.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fedge.compression import PayloadError, make_codec
from fedge.compression.registry import CodecIdError, register_codec
from fedge.compression.wire import HEADER_SIZE, pack_payload
from fedge.protocol.plugins import PluginError, load_plugins

PLUGINS = Path(__file__).resolve().parent.parent / "examples" / "plugins"


@pytest.fixture(scope="module", autouse=True)
def _examples_on_path():
    sys.path.insert(0, str(PLUGINS))
    load_plugins("int8_codec,geomedian,decaying_fedavg")
    yield
    sys.path.remove(str(PLUGINS))


def test_the_user_codec_round_trips_with_its_reserved_id() -> None:
    codec = make_codec("int8sym")
    x = torch.randn(1000)
    payload = codec.encode(x)
    assert payload[5] == 200 and len(payload) == HEADER_SIZE + 4 + 1000  # its wire id, honest bytes
    assert (codec.decode(payload, 1000) - x).abs().max() <= x.abs().max() / 127 / 2 + 1e-6
    forged = bytearray(payload)
    forged[HEADER_SIZE:HEADER_SIZE + 4] = b"\xff\xff\xff\x7f"  # a NaN scale: refused, with the checksum fixed
    from fedge.compression.wire import reseal

    with pytest.raises(PayloadError, match="scale"):
        codec.decode(reseal(forged), 1000)
    with pytest.raises(PayloadError, match="unknown codec id 201"):  # a codec this process does not know
        codec.decode(pack_payload(201, 1000, b"", b"\0" * 1004), 1000)


def test_codec_ids_outside_the_range_or_taken_are_refused() -> None:
    class Other(type(make_codec("int8sym"))):  # type: ignore[misc]
        name = "other"

    with pytest.raises(CodecIdError, match="taken by codec 'int8sym'"):
        register_codec("other", Other, codec_id=200)
    with pytest.raises(CodecIdError, match="outside the range reserved"):
        register_codec("other", Other, codec_id=7)
    with pytest.raises(CodecIdError, match="needs a wire id"):
        register_codec("other", Other)
    with pytest.raises(PluginError, match="cannot be imported"):
        load_plugins("no_such_plugin_module")


def test_the_user_aggregator_resists_an_outlier() -> None:
    from fedge.aggregation.robust import aggregator_memory_bytes, make_aggregator

    rule = make_aggregator("geomedian:iterations=20", numel=3, capacity=5)
    for value in (1.0, 1.1, 0.9, 1.05):
        rule.add(torch.full((3,), value), 1.0)
    rule.add(torch.full((3,), 1e6), 1.0)  # one attacker
    assert torch.allclose(rule.result(), torch.full((3,), 1.0), atol=0.2)
    assert aggregator_memory_bytes("geomedian", 10, 4) == 4 * 10 * 4 + 8 * 10 * 6


def test_the_user_algorithm_is_registered_with_its_device_handler() -> None:
    from fedge.edge_client.app import handled_algorithms
    from fedge.protocol.plugins import device_handler
    from fedge.server.algorithms.registry import algorithm_class

    cls = algorithm_class("fedavg_decay:decay=0.5")
    assert cls.plugin_handler == "fedavg_decay" and cls.device_handler in handled_algorithms
    # FedAvg's handler built around the plugin's change of config: the device's layers included
    handler = device_handler("fedavg_decay")
    assert getattr(handler, "fedge_device_layers", False) and cls.device_layers
