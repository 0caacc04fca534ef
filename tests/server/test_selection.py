"""The system-aware selection layer (``selection=oort``): fast and useful devices first, every
device's participation kept within its bounds, a fairness figure, and the refusals."""

from __future__ import annotations

import pytest
from flwr.app import MetricRecord, RecordDict

from fedge.server.engine.algorithm import Outgoing, Reply
from fedge.server.engine.layers.base import Failure
from fedge.server.engine.layers.selection import Oort, SelectionLayer, jain_index
from fedge.server.settings import SettingsError
from tests.server.engines import build_engine
from tests.server.in_process_grid import InProcessGrid


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _simulate(layer: SelectionLayer, clock: Clock, steps: int, slow: set[int], nodes: list[int], k: int) -> list[list[int]]:
    """Steps of ``k`` of ``nodes``; a slow device replies in 50 s, the others in 10 s."""
    chosen = []
    for number in range(1, steps + 1):
        picked = layer.select(number, nodes)
        assert len(picked) == k and len(set(picked)) == k
        layer.outgoing(None, [Outgoing(n, RecordDict(), "train") for n in picked])  # type: ignore[arg-type]
        start = clock.now
        for node in sorted(picked, key=lambda n: n in slow):
            clock.now = start + (50.0 if node in slow else 10.0)
            layer.arrived(None, Reply(node, RecordDict({"metrics": MetricRecord(  # type: ignore[arg-type]
                {"train-loss": 0.5, "num-examples": 100})})))
        chosen.append(picked)
    return chosen


def test_slow_devices_are_chosen_less_yet_no_device_leaves_its_bounds() -> None:
    clock = Clock()
    rule = Oort()
    layer = SelectionLayer(rule, seed=1, per_step=8, clock=clock)
    nodes, slow = list(range(16)), {0, 1, 2, 3}
    chosen = _simulate(layer, clock, 200, slow, nodes, 8)
    counts = {n: sum(n in step for step in chosen) for n in nodes}
    fair = 200 * 8 / 16
    with_slow = sum(bool(slow & set(step)) for step in chosen[20:])
    # uniform sampling puts a slow device in 96% of such steps; this rule in far fewer
    assert with_slow / len(chosen[20:]) < 0.5, with_slow
    for node, count in counts.items():
        assert rule.min_share * fair - 1 <= count <= rule.max_share * fair + 1, (node, count, fair)
    participation = layer.participation()
    assert participation["devices"] == 16 and participation["jain"] == pytest.approx(
        jain_index([float(c) for c in counts.values()]), abs=1e-4)
    assert 0.8 < participation["jain"] < 1.0


def test_a_device_that_declined_rests_one_step_and_a_timeout_counts_the_whole_wait() -> None:
    clock = Clock()
    layer = SelectionLayer(Oort(explore=0.0, min_share=0.0), seed=1, per_step=2, clock=clock)
    nodes = [1, 2, 3]
    _simulate(layer, clock, 3, set(), nodes, 2)
    layer.missed(None, Failure(1, "over-budget", "3 rounds today"))  # type: ignore[arg-type]
    assert 1 not in layer.select(4, nodes)
    layer.outgoing(None, [Outgoing(2, RecordDict(), "train")])  # type: ignore[arg-type]
    clock.now += 300.0
    layer.missed(None, Failure(2, "timeout", "no reply"))  # type: ignore[arg-type]
    assert layer.devices[2].duration > 100


def test_state_round_trips_and_rule_specs_are_checked() -> None:
    clock = Clock()
    layer = SelectionLayer(Oort(), seed=3, per_step=2, clock=clock)
    _simulate(layer, clock, 5, {1}, [1, 2, 3, 4], 2)
    again = SelectionLayer(Oort(), seed=3, per_step=2, clock=clock)
    again.load_state_dict(layer.state_dict())
    assert again.select(6, [1, 2, 3, 4]) == layer.select(6, [1, 2, 3, 4])
    assert Oort.parse("uniform") is None and Oort.parse("oort:alpha=1,explore=0.1") == Oort(alpha=1.0, explore=0.1)
    for bad in ("random", "oort:beta=1", "oort:explore=2", "oort:min-share=2"):
        with pytest.raises(SettingsError):
            Oort.parse(bad)


def test_jain_index() -> None:
    assert jain_index([3.0, 3.0, 3.0]) == 1.0
    assert jain_index([4.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff:concurrency=2,buffer=2"])
def test_oort_runs_in_the_engine_and_reports_participation(tmp_path, algorithm) -> None:
    from fedge.server.run.initial_model import initial_params
    from fedge.tasks import make_task

    engine = build_engine(dict(algorithm=algorithm, selection="oort", rounds=3, clients_per_round=2, local_epochs=1,
                               round_timeout=5.0, wait_for_nodes=1.0, run_dir=str(tmp_path)))
    result = engine.run(InProcessGrid(4), initial_params(make_task("digits"), 42))
    assert len(result.rows) == 3
    assert all(row.extra["participation"]["devices"] == 4 for row in result.rows)
    assert engine.layer("selection").steps >= 3


def test_uniform_counts_the_engines_sample_for_the_fairness_figure(tmp_path) -> None:
    from fedge.server.run.initial_model import initial_params
    from fedge.tasks import make_task

    engine = build_engine(dict(rounds=3, clients_per_round=2, local_epochs=1, round_timeout=5.0, wait_for_nodes=1.0,
                               run_dir=str(tmp_path)))
    result = engine.run(InProcessGrid(4), initial_params(make_task("digits"), 42))
    counts = [row.extra["participation"] for row in result.rows]
    # every connected device counts, chosen or not; three steps of two sent messages each
    assert [c["devices"] for c in counts] == [4, 4, 4]
    layer = engine.layer("selection")
    assert layer.rule is None and sum(d.chosen for d in layer.devices.values()) == 6
    assert counts[-1]["jain"] == pytest.approx(jain_index([float(d.chosen) for d in layer.devices.values()]), abs=1e-4)
    private = build_engine(dict(rounds=1, clients_per_round=2, run_dir=str(tmp_path / "dp"),
                                differential_privacy="gaussian:noise=1.0,clip=1.0,delta=1e-5"))
    assert private.layer("selection") is None  # DP rows carry no node facts


@pytest.mark.parametrize("values, message", [
    ({"differential_privacy": "gaussian:noise=1.0,clip=1.0,delta=1e-5"}, "Poisson"),
    ({"algorithm": "gossip:topology=ring"}, "fixed set"),
])
def test_oort_is_refused_where_it_would_break_a_promise(tmp_path, values, message) -> None:
    with pytest.raises(SettingsError, match=message):
        build_engine(dict(selection="oort", rounds=1, clients_per_round=2, run_dir=str(tmp_path), **values))
