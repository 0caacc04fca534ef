"""The system-aware selection layer (``selection=oort``): fast and useful devices first, every
device's participation kept within its bounds, a fairness figure, and the refusals."""

from __future__ import annotations

import pytest
from flwr.app import MetricRecord, RecordDict

from fedge.protocol.resources import RESOURCES_RECORD, ResourceReport
from fedge.server.engine.algorithm import Outgoing, Reply
from fedge.coordinator.layer import Failure
from fedge.coordinator.selection_layer import Oort, SelectionLayer, jain_index
from fedge.server.settings import SettingsError
from tests.server.engines import build_engine
from tests.server.in_process_grid import InProcessGrid


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _simulate(layer: SelectionLayer, clock: Clock, steps: int, slow: set[int], nodes: list[int],
              k: int) -> list[list[int]]:
    """Steps of ``k`` of ``nodes``; a slow device replies in 50 s, the others in 10 s."""
    chosen = []
    for number in range(1, steps + 1):
        picked = layer.select(nodes, layer.per_step, number)
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


def _report(wall: float) -> MetricRecord:
    return ResourceReport(cpu_seconds=wall, train_cpu_seconds=wall, encode_cpu_seconds=0.0, overhead_cpu_seconds=0.0,
                          startup_cpu_seconds=0.0, wall_seconds=wall, peak_rss_mib=100.0, bytes_down=1e4,
                          bytes_up=1e3).record()


def _steps_with_a_slow_device(reports: bool, seed: int, liar: int | None = None) -> int:
    """30 steps of 8 of 16 devices, 4 of them 5x slow (2.0 s of work against 0.4 s), each message
    also waiting 0-3 s outside the device, as for an idle SuperNode's poll: how many steps ask a
    slow device."""
    import random

    jitter, clock = random.Random(seed), Clock()
    layer = SelectionLayer(Oort(), seed=seed, per_step=8, clock=clock)
    nodes, slow = list(range(16)), {0, 1, 2, 3}
    count = 0
    for number in range(1, 31):
        picked = layer.select(nodes, layer.per_step, number)
        count += bool(slow & set(picked))
        layer.outgoing(None, [Outgoing(n, RecordDict(), "train") for n in picked])  # type: ignore[arg-type]
        start = clock.now
        trips = {n: (2.0 if n in slow else 0.4) + jitter.uniform(0.0, 3.0) for n in picked}
        for node in sorted(picked, key=trips.__getitem__):
            clock.now = start + trips[node]
            work = 2.0 if node in slow else 0.4
            content = RecordDict({"metrics": MetricRecord({"train-loss": 0.5, "num-examples": 100})})
            if reports:
                content[RESOURCES_RECORD] = _report(0.01 if node == liar else work)
            layer.arrived(None, Reply(node, content))  # type: ignore[arg-type]
    return count


def test_oort_ranks_devices_by_their_reported_time_not_by_the_engines_polling() -> None:
    """With 0-3 s of polling in every round trip, the round trip alone blurs a 0.4 s device with a
    2.0 s one. Taking each device's reported wall time (bounded below by round trip - L) asks
    slow devices in fewer steps, over five seeds."""
    by_trip = [_steps_with_a_slow_device(False, seed) for seed in range(1, 6)]
    by_report = [_steps_with_a_slow_device(True, seed) for seed in range(1, 6)]
    assert sum(by_report) < sum(by_trip), (by_report, by_trip)
    # exploration (2 steps) and the owed minimum share (2 more) are all that is left
    assert max(by_report) <= 5, by_report


def test_a_device_that_understates_its_time_is_held_to_what_the_coordinator_saw() -> None:
    """L is learnt from the replies (at most the 3 s of polling here); a device reporting 0.01 s
    still counts its round trip minus L, and an honest report within L counts as reported."""
    import random

    layer, jitter = SelectionLayer(Oort(), seed=1, per_step=4, clock=Clock()), random.Random(1)
    metrics = {"metrics": MetricRecord({"train-loss": 0.5, "num-examples": 100})}
    for _ in range(64):
        wall = jitter.choice([0.4, 2.0])
        reply = Reply(1, RecordDict({**metrics, RESOURCES_RECORD: _report(wall)}))
        layer._device_seconds(wall + jitter.uniform(0.0, 3.0), reply)  # type: ignore[arg-type]
    assert 2.4 < layer._outside() <= 3.0
    liar = RecordDict({**metrics, RESOURCES_RECORD: _report(0.01)})
    assert layer._device_seconds(2.0 + 2.5, Reply(0, liar)) >= 4.5 - 3.0  # type: ignore[arg-type]
    honest = RecordDict({**metrics, RESOURCES_RECORD: _report(0.4)})
    assert layer._device_seconds(0.4 + 1.5, Reply(2, honest)) == 0.4  # type: ignore[arg-type]
    silent = RecordDict(metrics)  # no report: the round trip minus L
    assert layer._device_seconds(5.0, Reply(3, silent)) == pytest.approx(5.0 - layer._outside())  # type: ignore[arg-type]


def test_a_device_that_declined_rests_one_step_and_a_timeout_counts_the_whole_wait() -> None:
    clock = Clock()
    layer = SelectionLayer(Oort(explore=0.0, min_share=0.0), seed=1, per_step=2, clock=clock)
    nodes = [1, 2, 3]
    _simulate(layer, clock, 3, set(), nodes, 2)
    layer.arrived(None, Failure(1, "over-budget", "3 rounds today"))  # type: ignore[arg-type]
    assert 1 not in layer.select(nodes, layer.per_step, 4)
    layer.outgoing(None, [Outgoing(2, RecordDict(), "train")])  # type: ignore[arg-type]
    clock.now += 300.0
    layer.arrived(None, Failure(2, "timeout", "no reply"))  # type: ignore[arg-type]
    assert layer.devices[2].duration > 100


def test_state_round_trips_and_rule_specs_are_checked() -> None:
    clock = Clock()
    layer = SelectionLayer(Oort(), seed=3, per_step=2, clock=clock)
    _simulate(layer, clock, 5, {1}, [1, 2, 3, 4], 2)
    again = SelectionLayer(Oort(), seed=3, per_step=2, clock=clock)
    again.load_state_dict(layer.state_dict())
    assert again.select([1, 2, 3, 4], 2, 6) == layer.select([1, 2, 3, 4], 2, 6)
    assert Oort.parse("uniform") is None and Oort.parse("oort:alpha=1,explore=0.1") == Oort(alpha=1.0, explore=0.1)
    for bad in ("random", "oort:beta=1", "oort:explore=2", "oort:min-share=2"):
        with pytest.raises(ValueError):
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
