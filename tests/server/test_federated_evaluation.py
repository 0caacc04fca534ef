"""Federated evaluation: the devices measure the step's model on their held-out part, and the
combined figure is the example-weighted mean of theirs (the figure on the union of their parts)."""

from __future__ import annotations

import pytest

from fedge.compression import derive_seed
from fedge.edge_client.node_data import holdout_split, node_data
from fedge.server.algorithms.registry import make_algorithm
from fedge.server.engine.loop import Engine, make_context
from fedge.server.run.initial_model import initial_params
from fedge.server.run.run_directory import RunDirectory
from fedge.server.settings import RunSettings, SettingsError
from fedge.tasks import evaluate, make_task, unflatten_state
from tests.server.in_process_grid import FakeClock, InProcessGrid

DEVICES_ONLY = "tests.tasks.user_tasks:DevicesOnlyDigits"


def _engine(tmp_path, task, **overrides) -> Engine:
    values = dict(task=task.spec, rounds=2, clients_per_round=4, local_epochs=1, round_timeout=5.0,
                  wait_for_nodes=1.0, run_dir=str(tmp_path / "run"), partitioning="iid")
    settings = RunSettings(**{**values, **overrides})
    run_dir = RunDirectory(settings.run_dir)
    run_dir.start(settings)
    clock = FakeClock()
    return Engine(make_algorithm(settings.algorithm, make_context(settings, task)), run_dir, clock=clock,
                  sleep=clock.sleep)


@pytest.mark.parametrize("algorithm", ["fedavg", "easgd", "fedbuff:concurrency=4,buffer=2"])
def test_the_federated_figure_is_the_example_weighted_mean_of_the_devices(tmp_path, algorithm: str) -> None:
    task = make_task(DEVICES_ONLY)
    engine = _engine(tmp_path, task, algorithm=algorithm, rounds=3, local_epochs=5)
    assert engine.ctx.evaluation == "federated"  # auto: the task has no central data
    grid = InProcessGrid(4)
    result = engine.run(grid, initial_params(task, 42))
    row = result.rows[-1]
    assert row.evaluation == "federated" and row.extra["federated_replies"] == 4
    # every device's held-out part, known here: the node's data split as the device splits it
    model = task.build_model()
    model.load_state_dict(unflatten_state(result.model, engine.ctx.template))
    figures, weights = [], []
    for pid in range(4):
        data = node_data({"partition-id": pid, "num-partitions": 4}, task, "iid")
        _, held = holdout_split(data, 0.2, derive_seed(42, pid, purpose="holdout"))
        figures.append(evaluate(model, held, task))
        weights.append(len(held))
    assert row.extra["federated_examples"] == sum(weights)
    for name in ("loss", "accuracy"):
        expected = sum(w * f[name] for w, f in zip(weights, figures)) / sum(weights)
        assert row.metrics[name] == pytest.approx(expected, rel=1e-5), name
    assert row.score > 0.3  # it learned (chance: 0.1), measured on samples no device trained on


def test_both_keeps_central_figures_primary_and_records_the_devices(tmp_path) -> None:
    task = make_task("digits")
    engine = _engine(tmp_path, task, evaluate="both", rounds=1)
    row = engine.run(InProcessGrid(4), initial_params(task, 42)).rows[-1]
    assert row.evaluation == "central" and 0 <= row.accuracy <= 1
    assert row.extra["federated_replies"] == 4 and 0 <= row.extra["federated_accuracy"] <= 1


def test_central_evaluation_needs_central_data(tmp_path) -> None:
    task = make_task(DEVICES_ONLY)
    with pytest.raises(SettingsError, match="needs central held-out data"):
        _engine(tmp_path, task, evaluate="central")


def test_the_stop_rule_follows_the_task_metric_in_either_direction(tmp_path) -> None:
    task = make_task("digits")
    engine = _engine(tmp_path, task, rounds=5, stop_at="loss<=100")  # met at the first step
    result = engine.run(InProcessGrid(4), initial_params(task, 42))
    assert result.reached_target and [r.round for r in result.rows] == [1]
    with pytest.raises(SettingsError, match="reports loss, accuracy"):
        _engine(tmp_path / "x", task, stop_at="mse<=0.1")
    with pytest.raises(SettingsError, match="not 'METRIC>=X'"):
        RunSettings(stop_at="accuracy=0.9")
    assert RunSettings(stop_accuracy=0.9).stop_rule == ("accuracy", ">=", 0.9)


def test_evaluation_replies_pass_the_updates_door_and_fail_by_kind(tmp_path) -> None:
    """An evaluation reply is screened like an update (a smuggled record is refused), a device's typed
    refusal keeps its kind, and neither moves the combined figure."""
    from flwr.app import ArrayRecord, Message, MessageType

    from fedge.edge_client.app import app as fedge_app
    from fedge.protocol.refusals import refusal_content

    task = make_task(DEVICES_ONLY)

    def app(msg, context):  # noqa: ANN001, ANN202 - Flower's handler signature
        reply = fedge_app(msg, context)
        if msg.metadata.message_type != MessageType.EVALUATE:
            return reply
        partition = context.node_config["partition-id"]
        if partition == 1:  # smuggles a record no evaluation reply carries
            reply.content["smuggled"] = ArrayRecord()
        if partition == 2:
            return Message(refusal_content("bad-config", "this device cannot evaluate that task"), reply_to=msg)
        return reply

    engine = _engine(tmp_path, task, rounds=1)
    grid = InProcessGrid(4, app=app)
    row = engine.run(grid, initial_params(task, 42)).rows[-1]
    ignored = {entry["node"]: entry for entry in row.extra["federated_ignored"]}
    assert ignored[grid.node_id(1)]["kind"] == "invalid" and "unknown record names" in ignored[grid.node_id(1)]["reason"]
    assert ignored[grid.node_id(2)]["kind"] == "bad-config"
    assert row.extra["federated_replies"] == 2 and len(ignored) == 2
