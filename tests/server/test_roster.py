"""The roll call: nodes ordered by partition, so one seed draws the same partitions whatever
numbers Flower gives the nodes (it gives new random ones in every run)."""

from __future__ import annotations

import random

from flwr.app import Context, RecordDict

from fedge.protocol.roster import read_roster_answer, roster_answer
from fedge.server.engine.roster import Roster
from fedge.server.run.initial_model import initial_params
from fedge.server.run.metrics_row import without_timing
from fedge.tasks import make_task
from tests.server.engines import build_engine
from tests.server.in_process_grid import InProcessGrid

TASK = make_task("digits")


def _renumbered(num_nodes: int, seed: int) -> InProcessGrid:
    """An in-process grid whose node numbers are random, as Flower's are (partition i keeps its data)."""
    grid = InProcessGrid(num_nodes)
    numbers = random.Random(seed).sample(range(10**6, 10**7), num_nodes)
    grid.contexts = {n: Context(run_id=1, node_id=n, node_config=dict(c.node_config), state=RecordDict(),
                                run_config=dict(c.run_config)) for n, c in zip(numbers, grid.contexts.values())}
    return grid


def test_a_device_answers_with_its_partition_and_nothing_else() -> None:
    assert read_roster_answer(roster_answer({"partition-id": 7, "data": "/secret.npz"})) == 7
    assert read_roster_answer(roster_answer({"data": "own.npz"})) is None  # a real device: no partition id
    answer = roster_answer({"partition-id": "3"})
    assert read_roster_answer(answer) == 3 and list(answer.keys()) == ["fedge.roster"]
    assert read_roster_answer(RecordDict()) is None


def test_named_nodes_come_first_by_name_then_the_rest_by_number() -> None:
    roster = Roster()
    roster.names = {50: 2, 10: None, 30: 0, 20: 1, 5: None}
    assert roster.order([5, 10, 20, 30, 50]) == [30, 20, 50, 5, 10]


def test_runs_with_other_node_numbers_sample_the_same_partitions_and_train_the_same_model(tmp_path) -> None:
    runs = []
    for k, seed in enumerate((1, 2)):
        engine = build_engine(dict(rounds=3, clients_per_round=3, local_epochs=1, round_timeout=5.0,
                                   wait_for_nodes=1.0, run_dir=str(tmp_path / f"run{k}")))
        grid = _renumbered(8, seed)
        result = engine.run(grid, initial_params(TASK, 42))
        partitions = [sorted(int(grid.contexts[m.metadata.dst_node_id].node_config["partition-id"])
                             for m in grid.pushed if m.metadata.group_id == f"{r}-train") for r in (1, 2, 3)]
        runs.append((partitions, [without_timing(row.to_json()) for row in result.rows], len(grid.roll_calls)))
    (partitions_a, rows_a, asked_a), (partitions_b, rows_b, asked_b) = runs
    assert partitions_a == partitions_b and rows_a == rows_b
    assert asked_a == asked_b == 8  # each node asked once, in the first round
