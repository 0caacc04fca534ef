"""The lattice downlink end to end on the engine's stand-in Grid, with the real device handlers:
devices that miss versions rejoin with copies bit-identical to the coordinator's; past the cache a
snapshot is sent; a copy that does not match is refused before any training."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Message

from fedge.edge_client.downlink import receive_downlink
from fedge.protocol.downlink import DownlinkHeader
from fedge.edge_client.public_copy import OutOfSyncError
from fedge.protocol import CONFIG_RECORD, DOWNLINK_RECORD, MODEL_RECORD, ProtocolError
from fedge.protocol.config_keys import DOWNLINK_BASE_DIGEST, DOWNLINK_DIGEST
from fedge.protocol.failures import FailureKind
from fedge.server.engine.algorithm import Step
from fedge.server.engine.layers import Failure
from fedge.coordinator.step import Reply
from fedge.coordinator.downlink_layer import DownlinkLayer
from fedge.tasks import flatten_state, tensor_sizes
from tests.server.in_process_grid import InProcessGrid
from tests.server.test_engine import TASK, _engine, _start


def _receive(grid: InProcessGrid, node: int, content) -> torch.Tensor:  # type: ignore[no-untyped-def]
    message = Message(content, dst_node_id=node, message_type="train")
    header = DownlinkHeader.read(content.config_records[CONFIG_RECORD])
    if header is not None:
        receive_downlink(message, grid.contexts[node], header)
    return flatten_state(message.content.array_records[MODEL_RECORD].to_torch_state_dict())


def _send(layer: DownlinkLayer, algorithm, version: int, nodes: list[int]) -> dict[int, object]:  # type: ignore[no-untyped-def]
    """What the algorithm's messages of ``version`` carry once the downlink layer has shipped the model."""
    step = Step(version, nodes)
    outgoing = algorithm.configure(step, nodes)
    layer.outgoing(step, outgoing)
    return {o.node: o.content for o in outgoing}


def _send_current(engine, grid: InProcessGrid, version: int) -> dict[int, object]:  # type: ignore[no-untyped-def]
    return _send(engine.layer("downlink"), engine.algorithm, version, grid.get_node_ids())


def test_devices_missing_versions_rejoin_bit_identical_and_past_the_cache_get_a_snapshot(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=6, clients_per_round=2, downlink_codec="lattice:ratio=0.05,cache=2")
    grid = InProcessGrid(6)
    rows = engine.run(grid, _start(engine)).rows
    assert all(not row.rejected for row in rows)  # every device's digest check passed
    assert sum(row.extra["downlink_catch_up"] for row in rows) > 0  # some came back within the cache
    later_snapshots = sum(row.extra["downlink_snapshot"] for row in rows[3:])
    assert later_snapshots > 0  # some were away longer than 2 versions (or new)
    broadcast = engine.layer("downlink").broadcast
    contents = _send_current(engine, grid, 7)
    for node in grid.get_node_ids():  # everyone rejoins at version 7, from wherever it was
        copy = _receive(grid, node, contents[node])
        assert torch.equal(copy, broadcast.public)  # bit-identical to the coordinator's copy


def test_a_copy_that_does_not_match_is_refused_and_the_base_is_shipped_when_needed(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=1, downlink_codec="lattice")
    grid = InProcessGrid(2)
    engine.algorithm.start(_start(engine))
    downlink = engine.layer("downlink")
    node, other = grid.get_node_ids()
    contents = _send_current(engine, grid, 1)
    _receive(grid, node, contents[node])  # a snapshot: accepted
    downlink.arrived(Step(1, [node]), Reply(node, contents[node]))
    engine.algorithm.params = engine.algorithm.params + 0.01
    contents = _send_current(engine, grid, 2)
    config = contents[node].config_records[CONFIG_RECORD]
    good = config[DOWNLINK_DIGEST]
    config[DOWNLINK_DIGEST] = good ^ 1
    with pytest.raises(OutOfSyncError, match="digest"):
        _receive(grid, node, contents[node])
    config[DOWNLINK_DIGEST] = good
    with pytest.raises(OutOfSyncError, match="no copy"):  # the other device never got version 1
        _receive(grid, other, contents[node])
    contents[other].config_records[CONFIG_RECORD][DOWNLINK_BASE_DIGEST] ^= 1  # as if this device's torch drew another initial model
    with pytest.raises(OutOfSyncError, match="downlink base") as refused:
        _receive(grid, other, contents[other])
    # the device's refusal is typed: the coordinator ships the base because of its kind, not its words
    assert refused.value.kind == FailureKind.NEEDS_BASE
    downlink.arrived(Step(2, [other]), Failure(other, refused.value.kind, "any words"))
    shipped = _send(downlink, engine.algorithm, 2, [other])[other]
    assert "base" in shipped.array_records[DOWNLINK_RECORD]
    assert torch.equal(_receive(grid, other, shipped), downlink.broadcast.public)
    payload = shipped.array_records[DOWNLINK_RECORD]
    payload["steps"] = payload["base"]  # a snapshot whose steps do not fit the model
    with pytest.raises(ProtocolError):
        _receive(grid, other, shipped)


def test_a_run_from_a_model_file_ships_its_base_once(tmp_path) -> None:
    """Devices cannot rebuild a model file's weights: the base travels with the first snapshot."""
    template = TASK.build_model().state_dict()
    downlink = DownlinkLayer("lattice")  # as build() makes it for a run with init = "pretrained.pt"
    downlink.begin(flatten_state(template), tensor_sizes(template), seeded=False)
    downlink.ship_start()
    engine = _engine(tmp_path / "b")
    start = _start(engine) + 0.05  # as if a model file had been loaded
    grid = InProcessGrid(1)
    (node,) = grid.get_node_ids()
    engine.algorithm.start(start)
    content = _send(downlink, engine.algorithm, 1, [node])[node]  # its first message's model is the base
    assert torch.equal(downlink.broadcast.base, start) and not downlink.broadcast.seeded
    assert "base" in content.array_records[DOWNLINK_RECORD]
    assert torch.equal(_receive(grid, node, content), downlink.broadcast.public)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff:concurrency=3,buffer=3"])
def test_a_tcs_uplink_sends_on_the_change_each_device_received(tmp_path, algorithm) -> None:
    """The engine keeps, per node, the coordinates its latest lattice message moved; the device keeps
    the same from the change it applied; each update is decoded on its own node's support (a payload
    decoded on another support is refused by name, so a used update proves the two agreed). The
    uplink is smaller than the same values codec's dense payload, and the model trains."""
    spec = "tcs:extra=0.01+qsgd:bits=4"
    engine = _engine(tmp_path, rounds=10, codec=spec, downlink_codec="lattice:ratio=0.05", algorithm=algorithm)
    grid = InProcessGrid(3)
    start = _start(engine)
    result = engine.run(grid, start)
    rows = result.rows
    assert all(row.clients_used >= 2 and not row.rejected for row in rows), [r.rejected for r in rows]
    assert all(row.uplink_bytes < row.clients_used * engine.ctx.numel // 4 for row in rows)  # under 2 bits each
    assert engine.evaluate(result.model)["accuracy"] > engine.evaluate(start)["accuracy"] + 0.3
    layer = engine.layer("downlink")
    assert isinstance(layer, DownlinkLayer) and len(layer.broadcast.supports) == 3
