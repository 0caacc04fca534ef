"""Gossip through the engine: relayed CHOCO messages keep every public copy identical everywhere."""

from __future__ import annotations

import pytest
import torch

from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.public_copy import PublicCopy
from fedge.server.settings import SettingsError
from tests.server.in_process_grid import InProcessGrid
from tests.server.test_engine import _engine, _start


def _copies(grid: InProcessGrid, node: int, peers: list[int]) -> dict[int, tuple[torch.Tensor, int]]:
    store = NodeStore(grid.contexts[node].state, "gossip").child("public")
    out = {}
    for j in peers:
        copy = PublicCopy(store, str(j))
        out[j] = (copy.get(), copy.version)
    return out


@pytest.mark.parametrize("topology", ["ring", "onepeer"])
def test_public_copies_agree_bit_for_bit_between_a_node_its_peers_and_the_coordinator(tmp_path, topology) -> None:
    engine = _engine(tmp_path, rounds=3, clients_per_round=4, algorithm=f"gossip:topology={topology}",
                     codec="qsgd:bits=4,bucket=64,norm=max")
    grid = InProcessGrid(4)
    result = engine.run(grid, _start(engine))
    algorithm = engine.algorithm
    members = grid.get_node_ids()
    for i, node in enumerate(members):
        mine = _copies(grid, node, algorithm.holders[i])
        for j, (value, version) in mine.items():
            assert version == 2  # after step 3 every node holds the copies of version 2
            owner_copy, _ = _copies(grid, members[j], [j])[j]
            assert torch.equal(value, owner_copy)  # node i's copy of x_hat_j == node j's own
            # the coordinator's copy is one step ahead: version 2 plus the pending q_j of step 3
            ahead = value + algorithm.wire(3).decode(algorithm.pending[j], value.numel())
            assert torch.equal(ahead, algorithm.public[j])
    row = result.rows[-1]
    assert row.clients_used == 4 and row.measurement_bytes == 4 * 4 * engine.ctx.numel
    assert row.extra["consensus_distance"] >= 0 and 0 <= row.extra["node_accuracy_worst"] <= 1
    assert row.uplink_bytes < row.uplink_fp32_bytes / 7  # compressed q's, not models
    # only step 1 sends full public copies; later steps relay compressed payloads
    first, later = result.rows[0].downlink_bytes, result.rows[-1].downlink_bytes
    assert later < first / 4
    assert all(m.metadata.message_type == "train.gossip" for m in grid.pushed)


def test_a_node_that_missed_a_step_is_resynced_in_full(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=2, clients_per_round=4, algorithm="gossip:topology=ring",
                     codec="qsgd:bits=4", round_timeout=3.0)
    grid = InProcessGrid(4, silent={2})
    result = engine.run(grid, _start(engine))
    assert [r.clients_used for r in result.rows] == [3, 3]
    assert result.rows[0].rejected[0]["reason"] == "no reply within 3 s"
    silent_node = grid.node_id(2)
    # it did not answer the roll call either: unnamed, it takes the last position (protocol.roster)
    assert engine.algorithm._position[silent_node] == 3 and 3 not in engine.algorithm.synced
    step2 = [m for m in grid.pushed if m.metadata.group_id == "2-train"]
    kinds = {m.metadata.dst_node_id: set(m.content.array_records) for m in step2}
    assert kinds[silent_node] == {"public"} and all(k == {"relay"} for n, k in kinds.items() if n != silent_node)


def test_gossip_refuses_fedavg_only_settings_and_bad_topologies(tmp_path) -> None:
    with pytest.raises(SettingsError, match="server-opt"):
        _engine(tmp_path, algorithm="gossip", server_opt="fedadam")
    with pytest.raises(ValueError, match="torus"):
        _engine(tmp_path / "a", algorithm="gossip:topology=torus", clients_per_round=8)
    with pytest.raises(ValueError, match="power of two"):
        _engine(tmp_path / "b", algorithm="gossip:topology=onepeer", clients_per_round=6)


def test_a_member_that_leaves_is_waited_for_then_the_run_stops_with_a_named_error(tmp_path) -> None:
    """Gossip runs over a fixed set of nodes (``fixed_membership``): the engine never samples it,
    and when a member disconnects it waits ``wait-for-nodes`` for one, then stops with
    :class:`NotEnoughNodesError` (before: a bare ValueError from inside the algorithm)."""
    from fedge.server.engine.loop import NotEnoughNodesError

    engine = _engine(tmp_path, rounds=3, clients_per_round=4, algorithm="gossip:topology=ring", wait_for_nodes=5.0)
    grid = InProcessGrid(4)
    gone = grid.node_id(3)

    def leave(row) -> None:  # type: ignore[no-untyped-def]
        grid.contexts.pop(gone, None)

    engine.on_row = leave
    with pytest.raises(NotEnoughNodesError, match="fixed set of 4 nodes"):
        engine.run(grid, _start(engine))
    assert engine.clock() >= 5.0  # it waited (simulated time) before giving up
    assert len(engine.run_dir.metrics.read()) == 1  # round 1 was published and checkpointed
