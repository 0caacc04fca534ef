"""EASGD (``algorithm = "easgd"``: FedAvg with ``fedge.coordinator.elastic_layer``): the center rule
against its definition through the engine's door and layers, and the device's elastic step (FedAvg's
handler) on the engine's in-process grid."""

from __future__ import annotations

import pytest
import torch
from flwr.app import MetricRecord, RecordDict

from fedge.compression import make_codec
from fedge.edge_client.node_store import NodeStore
from fedge.protocol import METRICS_RECORD, UPDATE_RECORD, payload_record
from fedge.coordinator.driver import StepDriver
from fedge.coordinator.tally import Tally
from fedge.server.algorithms.fedavg_layered import EASGD
from fedge.server.engine.algorithm import Rejected, Reply
from fedge.server.engine.loop import Engine, make_context
from fedge.server.run.run_directory import RunDirectory
from fedge.server.settings import RunSettings
from fedge.tasks import make_task
from tests.server.in_process_grid import InProcessGrid
from tests.server.test_engine import _engine, _start

N = 38_282


def _reply(delta: torch.Tensor, node: int, distance: float | None = 1.0) -> Reply:
    metrics = {"num-examples": 5, "train-loss": 0.1, **({} if distance is None else {"center-distance": distance})}
    content = RecordDict({UPDATE_RECORD: payload_record(make_codec("none").encode(delta)),
                          METRICS_RECORD: MetricRecord(metrics)})
    return Reply(node, content)


def _easgd(clients: int, **params) -> EASGD:
    settings = RunSettings(codec="none", clients_per_round=clients)
    return EASGD(make_context(settings, make_task("digits")), **params)


def _door(algorithm: EASGD, tmp_path) -> Engine:
    """Replies reach an algorithm through the engine's one door (screen, decode, bound, the layers)."""
    return Engine(algorithm, RunDirectory(tmp_path))


def _close(door: Engine, step):  # type: ignore[no-untyped-def]
    """The step closed as the engine closes it: the layers release the aggregate, the algorithm
    applies it, the layers close."""
    return door.close(StepDriver(door.layers, step, Tally(began=0.0)))


def test_center_moves_by_the_sum_of_elastic_differences(tmp_path) -> None:
    algorithm = _easgd(4, beta=0.8, alpha=0.0)  # alpha=0: the paper's coupling alpha = beta / n = 0.2
    assert algorithm.alpha == pytest.approx(0.2)
    center = torch.randn(N)
    algorithm.start(center)
    door = _door(algorithm, tmp_path)
    step = algorithm.open_step(1, [1, 2, 3, 4])
    algorithm.configure(step, [1, 2, 3, 4])
    deltas = [torch.randn(N) * 0.01 for _ in range(4)]
    for node, delta in enumerate(deltas, 1):
        door.absorb_reply(step, _reply(delta, node))
    outcome = _close(door, step)
    assert torch.allclose(outcome.model, center + sum(deltas), atol=1e-6)  # x~ <- x~ + sum_i delta_i


def test_partial_replies_move_the_center_beta_of_the_way_to_their_mean(tmp_path) -> None:
    algorithm = _easgd(4, beta=0.9, alpha=0.1)
    center = torch.zeros(N)
    algorithm.start(center)
    door = _door(algorithm, tmp_path)
    step = algorithm.open_step(1, [1, 2, 3, 4])
    algorithm.configure(step, [1, 2, 3, 4])
    models = [torch.full((N,), 1.0), torch.full((N,), 3.0)]  # x_i after local training
    for node, x in enumerate(models, 1):
        door.absorb_reply(step, _reply(0.1 * (x - center), node))  # delta_i = alpha (x_i - center)
    outcome = _close(door, step)
    assert torch.allclose(outcome.model, torch.full((N,), 0.9 * 2.0), atol=1e-6)
    assert outcome.extra["center_distance"] == 1.0


def test_bad_distance_is_rejected(tmp_path) -> None:
    algorithm = _easgd(2)
    algorithm.start(torch.zeros(N))
    door = _door(algorithm, tmp_path)
    step = algorithm.open_step(1, [1, 2])
    algorithm.configure(step, [1, 2])
    for bad in (float("nan"), -1.0, None):  # None: no elastic step was taken (a plain FedAvg device)
        with pytest.raises(Rejected, match="center-distance"):
            door.absorb_reply(step, _reply(torch.zeros(N), 1, distance=bad))
    with pytest.raises(ValueError, match="beta"):
        _easgd(2, beta=1.5)


def test_clients_keep_their_own_models_and_unsampled_ones_are_left_alone(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=3, clients_per_round=2, local_epochs=2, algorithm="easgd")
    grid = InProcessGrid(4)
    start = _start(engine)
    initial_accuracy = engine.evaluate(start)["accuracy"]
    result = engine.run(grid, start)
    sampled = [m.metadata.dst_node_id for m in grid.pushed]
    assert all(m.metadata.message_type == "train" for m in grid.pushed)  # FedAvg's handler, told alpha
    for node, context in grid.contexts.items():
        local = NodeStore(context.state, "easgd").get_tensor("local")
        assert (local is not None) == (node in sampled)  # never sampled: no state at all
    row = result.rows[-1]
    assert row.clients_used == 2 and 0 < row.extra["center_distance"]
    assert 0.0 <= row.extra["client_model_accuracy"] <= 1.0
    assert row.accuracy > initial_accuracy + 0.05  # the center learns
