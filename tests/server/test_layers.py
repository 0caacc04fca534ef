"""The engine's layers: adding one is one class and one registration; algorithms know none of the
cross-cutting features; every step runs one sequence; device refusals travel typed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fedge.coordinator.step import Outgoing
from fedge.protocol.failures import Failure
from fedge.server.engine.algorithm import Reply, Step, StepOutcome
from fedge.server.engine.layers import LAYERS, Layer, register_layer
from fedge.coordinator.tally import Tally
from tests.server.in_process_grid import InProcessGrid
from tests.server.test_engine import _engine, _start

ROOT = Path(__file__).resolve().parents[2]


class CountingLayer(Layer):
    """A layer written the way a new one would be: it counts the replies that reached the door,
    reports them in the row and keeps a running total in the checkpoint."""

    key = "test-counter"

    def __init__(self) -> None:
        self.total = 0

    @classmethod
    def build(cls, algorithm: Any, run_dir: Any = None) -> CountingLayer:
        return cls()

    def arrived(self, step: Step, event: Reply | Failure) -> bool:
        if isinstance(event, Reply):
            self.scratch(step, list).append(event.node)
        return False

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        seen = self.scratch(step, list)
        self.total += len(seen)
        outcome.extra["test_counter"] = {"step": len(seen), "total": self.total}

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError("no test-counter state")
        self.total = int(state["total"])


@pytest.fixture
def counting_layer():  # type: ignore[no-untyped-def]
    register_layer(CountingLayer)
    try:
        yield CountingLayer
    finally:
        LAYERS.remove(CountingLayer)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff:concurrency=3,buffer=2"])
def test_adding_a_layer_is_one_class_and_one_registration(tmp_path, counting_layer, algorithm) -> None:
    first = _engine(tmp_path, rounds=2, algorithm=algorithm)
    rows = first.run(InProcessGrid(3), _start(first)).rows
    assert [r.extra["test_counter"]["total"] for r in rows] == [rows[0].clients_used,
                                                                rows[0].clients_used + rows[1].clients_used]
    # its state is checkpointed under its key, and a resumed run continues from it
    assert first.run_dir.checkpoints.load().state["test-counter"] == {"total": rows[1].extra["test_counter"]["total"]}
    resumed = _engine(tmp_path, rounds=3, algorithm=algorithm)
    more = resumed.run(InProcessGrid(3), _start(resumed)).rows
    assert more[-1].extra["test_counter"]["total"] == rows[1].extra["test_counter"]["total"] + more[-1].clients_used


class KeepsBack(Layer):
    """Keeps back one node's message when a step's messages go out (the ``outgoing`` hook), as
    secure aggregation keeps back those of the devices that dealt no shares."""

    key = "test-keeps-back"

    @classmethod
    def build(cls, algorithm: Any, run_dir: Any = None) -> KeepsBack:
        return cls()

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        held = min(o.node for o in outgoing) if outgoing else None
        outgoing[:] = [o for o in outgoing if o.node != held]


def test_a_message_a_layer_keeps_back_is_not_sent_counted_or_waited_for(tmp_path) -> None:
    """The engine sends only the messages its layers let go: the step uses the others' updates, its
    downlink bytes are theirs, and the node held back is neither waited for nor counted as failed."""
    register_layer(KeepsBack)
    try:
        engine = _engine(tmp_path, rounds=2, clients_per_round=3, round_timeout=30.0)
        grid = InProcessGrid(3)
        rows = engine.run(grid, _start(engine)).rows
    finally:
        LAYERS.remove(KeepsBack)
    assert [r.clients_used for r in rows] == [2, 2] and all(not r.rejected for r in rows)
    plain = _engine(tmp_path / "plain", rounds=1, clients_per_round=3)
    full = plain.run(InProcessGrid(3), _start(plain)).rows[0]
    assert rows[0].downlink_bytes * 3 == full.downlink_bytes * 2  # two of the three fp32 models went out
    assert rows[-1].seconds < 30.0  # nobody waited for the held-back node's round timeout


def test_a_layer_key_must_be_new() -> None:
    class Clash(CountingLayer):
        key = "dp"

    with pytest.raises(ValueError, match="no other layer uses"):
        register_layer(Clash)


def test_algorithms_know_nothing_of_the_layers() -> None:
    """No file under server/algorithms/ mentions differential privacy, clipping or masking: those
    are layers (server/engine/layers/)."""
    words = re.compile(r"privacy|differential|\bdp\b|dp[-_]|clip|mask|secure|secagg", re.IGNORECASE)
    for path in sorted((ROOT / "server" / "algorithms").glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            assert not words.search(line), f"{path.name}:{number}: {line.strip()}"


def test_the_engine_has_one_step_sequence() -> None:
    """Synchronous, secure and asynchronous steps all end through ``Engine.close`` and then
    ``Engine.publish``: one place closes the algorithm's step, one builds a row and checkpoints."""
    loop = (ROOT / "server" / "engine" / "loop.py").read_text()
    assert loop.count("self.algorithm.close(") == 1
    assert loop.count("RoundRow(") == 1
    assert loop.count("self.run_dir.checkpoints.save(") == 1
    assert "algorithm.json" not in loop  # the run directory writes its own files


def test_a_device_out_of_sync_refuses_with_a_typed_record_counted_by_kind(tmp_path) -> None:
    """A device that lost its lattice copy answers with a ``refusal`` record of kind
    ``out-of-sync``, not a client error: the row counts it by kind and the next message to it is
    a snapshot, which it accepts."""
    engine = _engine(tmp_path, rounds=3, clients_per_round=2, downlink_codec="lattice:ratio=0.05")
    grid = InProcessGrid(2)
    lost = grid.node_id(1)

    def forget(row: Any) -> None:
        if row.round == 1:  # the device's store is wiped (a re-installed app)
            store = grid.contexts[lost].state
            for key in [k for k in store.keys() if k.startswith("downlink")]:
                del store[key]
            # and it now believes it holds another version than the coordinator's
            from fedge.edge_client import local

            local.store(grid.contexts[lost], "downlink").put_meta("lattice.meta", {"version": 99})
            local.store(grid.contexts[lost], "downlink").put_bytes("lattice.n", b"")
            local.store(grid.contexts[lost], "downlink").put_tensor("lattice.steps", torch.ones(1))

    engine.on_row = forget
    rows = engine.run(grid, _start(engine)).rows
    (refused,) = rows[1].rejected
    assert refused["node"] == lost and refused["kind"] == "out-of-sync", refused
    assert rows[1].extra["failures"] == {"out-of-sync": 1}
    assert rows[2].clients_used == 2 and not rows[2].rejected  # a snapshot brought it back
    assert rows[2].extra["downlink_snapshot"] == 1
