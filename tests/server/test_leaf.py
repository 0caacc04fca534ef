"""Two tiers in one process: a root engine whose nodes are two leaves' bridges, each leaf an engine
over three devices. FedAvg over the leaves, weighted by their examples, is FedAvg over the six
devices: the tree's model is the flat run's, round after round (fp32 updates both hops)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Context, Message

from fedge.edge_client.bridge import bridge_app
from fedge.server.leaf import LeafCoordinator, LeafError
from fedge.server.run.initial_model import initial_params
from fedge.tasks import make_task
from tests.server.engines import build_engine
from tests.server.in_process_grid import InProcessGrid

COMMON = dict(rounds=3, local_epochs=1, codec="none", weight_cap="none", round_timeout=5.0, wait_for_nodes=1.0)


def _leaf(tmp_path, name: str, partitions: range, rounds: int = 1) -> LeafCoordinator:
    engine = build_engine({**COMMON, "clients_per_round": len(partitions), "run_dir": str(tmp_path / name)})
    grid = InProcessGrid(len(partitions), first_node_id=5000 + 100 * partitions[0],
                         node_config={i: {"partition-id": p, "num-partitions": 6} for i, p in enumerate(partitions)})
    return LeafCoordinator(engine, grid, rounds=rounds)


def _bridges(leaves: dict[int, LeafCoordinator]):  # type: ignore[no-untyped-def]
    """One grid app for the root: each bridge node's ClientApp over its own leaf."""
    apps = {partition: bridge_app(leaf) for partition, leaf in leaves.items()}

    def app(msg: Message, context: Context) -> Message:
        return apps[int(context.node_config["partition-id"])](msg, context)

    return app


def test_fedavg_over_two_leaves_is_fedavg_over_their_devices(tmp_path) -> None:
    flat = build_engine({**COMMON, "clients_per_round": 6, "run_dir": str(tmp_path / "flat")})
    start = initial_params(make_task("digits"), 0)
    flat_rows = flat.run(InProcessGrid(6), start).rows

    leaves = {0: _leaf(tmp_path, "leaf-a", range(0, 3)), 1: _leaf(tmp_path, "leaf-b", range(3, 6))}
    root = build_engine({**COMMON, "clients_per_round": 2, "run_dir": str(tmp_path / "root")})
    result = root.run(InProcessGrid(2, app=_bridges(leaves)), start)
    for tree_row, flat_row in zip(result.rows, flat_rows, strict=True):
        assert tree_row.clients_used == 2 and not tree_row.rejected, tree_row.rejected
        assert tree_row.accuracy == pytest.approx(flat_row.accuracy, abs=0.01)
    torch.testing.assert_close(result.model, flat.algorithm.final_model(), rtol=0, atol=1e-6)  # moves ~0.07
    for leaf in leaves.values():  # each leaf kept its own log: one step per root round, its 3 devices
        rows = leaf.engine.run_dir.metrics.read()
        assert [r["round"] for r in rows] == [1, 2, 3] and all(r["clients_used"] == 3 for r in rows)


def test_a_compressed_hop_keeps_the_bridges_error_feedback_and_tracks_the_flat_run(tmp_path) -> None:
    """The leaf-to-root hop with a lossy codec: the bridge encodes its leaf's change as a device
    encodes its update, with its own error feedback in its node state (DoubleSqueeze's server); the
    tree learns as the flat run with the same codec does (6 rounds: 32.2% against 30.3% here)."""
    codec = "qsgd:bits=4,bucket=512,norm=max"
    start = initial_params(make_task("digits"), 0)
    flat = build_engine({**COMMON, "rounds": 6, "codec": codec, "clients_per_round": 6, "run_dir": str(tmp_path / "f")})
    flat_accuracy = flat.run(InProcessGrid(6), start).rows[-1].accuracy
    leaves = {0: _leaf(tmp_path, "leaf-a", range(0, 3)), 1: _leaf(tmp_path, "leaf-b", range(3, 6))}
    root = build_engine({**COMMON, "rounds": 6, "codec": codec, "clients_per_round": 2, "run_dir": str(tmp_path / "r")})
    grid = InProcessGrid(2, app=_bridges(leaves))
    result = root.run(grid, start)
    assert all(r.clients_used == 2 and r.uplink_bytes < r.uplink_fp32_bytes / 4 for r in result.rows)
    assert result.rows[-1].accuracy > root.evaluate(start)["accuracy"] + 0.1
    assert result.rows[-1].accuracy == pytest.approx(flat_accuracy, abs=0.05)
    assert all("fedge/bridge/memory" in c.state.array_records for c in grid.contexts.values())


def test_a_leaf_runs_several_steps_per_root_round_and_resumes_from_its_checkpoint(tmp_path) -> None:
    leaf = _leaf(tmp_path, "leaf", range(0, 3), rounds=2)
    start = initial_params(make_task("digits"), 0)
    first = leaf.step(1, start)
    assert first.count == 3 and first.weight > 0 and float(first.delta.norm()) > 0
    assert leaf.steps == 2
    again = _leaf(tmp_path, "leaf", range(0, 3), rounds=2)  # the leaf's process restarted
    again.step(2, start + first.delta)
    assert again.steps == 4  # resumed after its checkpointed step 2, not from 0
    assert [r["round"] for r in again.engine.run_dir.metrics.read()] == [1, 2, 3, 4]


def test_only_fedavg_leaves_are_built(tmp_path) -> None:
    engine = build_engine({**COMMON, "algorithm": "easgd", "clients_per_round": 2, "run_dir": str(tmp_path / "e")})
    with pytest.raises(LeafError, match="keeps a model of its own"):
        LeafCoordinator(engine, InProcessGrid(2))
