"""``fedge.flower.FedBuff`` / ``FedAsync`` from a user's ServerApp, in-process: a Grid stand-in
that runs each node's ClientApp (with or without ``compression_mod``) and answers after that node's
latency on a simulated clock. One version with every node and no delay is FedAvg's round; a slow
node never holds a version back and its updates count with their staleness; stale, corrupt and
error replies are dropped or refused with their reason."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedge.aggregation.staleness import Staleness
from fedge.flower import FedAsync, FedBuff
from fedge.protocol.records import UPDATE_RECORD, payload_record, read_payload
from tests.flower.test_compressed_strategy import _model, _user_app

NODES = [11, 12, 13]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class LatencyGrid:
    """Runs a node's ClientApp when its message is pushed; the reply is pulled ``latency[node]``
    simulated seconds later. ``tamper`` may change a reply before it is delivered."""

    def __init__(self, apps: dict[int, ClientApp], latency: dict[int, float], clock: Clock, tamper=None) -> None:
        self.apps, self.latency, self.clock, self.tamper = apps, latency, clock, tamper
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
                         for n in apps}
        self.waiting: dict[str, tuple[float, Message]] = {}
        self.sent: list[int] = []
        self._ids = 0

    def get_node_ids(self) -> list[int]:
        return list(self.apps)

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        ids = []
        for message in messages:
            self._ids += 1
            mid = f"m{self._ids}"
            message.metadata.__dict__["_message_id"] = mid
            node = message.metadata.dst_node_id
            reply = self.apps[node](message, self.contexts[node])
            reply.metadata.__dict__["_src_node_id"] = node
            reply.metadata.__dict__["_reply_to_message_id"] = mid
            if self.tamper is not None:
                self.tamper(node, reply)
            self.waiting[mid] = (self.clock() + self.latency[node], reply)
            self.sent.append(node)
            ids.append(mid)
        return ids

    def pull_messages(self, ids):  # type: ignore[no-untyped-def]
        ready = [mid for mid in ids if mid in self.waiting and self.waiting[mid][0] <= self.clock()]
        return [self.waiting.pop(mid)[1] for mid in ready]


def _run(strategy: FedBuff, grid: LatencyGrid, versions: int, clock: Clock,  # type: ignore[no-untyped-def]
         arrays: ArrayRecord | None = None):
    return strategy.start(grid, initial_arrays=arrays if arrays is not None else _model(), num_versions=versions,
                          train_config=ConfigRecord({"lr": 0.1}), clock=clock, sleep=clock.sleep)


def test_one_version_with_every_node_and_no_delay_is_fedavgs_round() -> None:
    clock = Clock()
    grid = LatencyGrid({n: _user_app(with_mod=False) for n in NODES}, {n: 1.0 for n in NODES}, clock)
    strategy, arrays = FedBuff(concurrency=3, buffer=3, uplink=None, staleness=Staleness("constant")), _model()
    result = _run(strategy, grid, 1, clock, arrays)
    # the same replies through Flower's FedAvg: the user's body is deterministic per node and round
    plain = FedAvg()
    messages = list(plain.configure_train(1, arrays, ConfigRecord({"lr": 0.1}), grid))
    replies = []
    for m in messages:
        m.metadata.__dict__["_message_id"] = m.object_id
        reply = grid.apps[m.metadata.dst_node_id](m, grid.contexts[m.metadata.dst_node_id])
        reply.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
        replies.append(reply)
    expected, _ = plain.aggregate_train(1, replies)
    assert expected is not None
    for name in arrays:
        np.testing.assert_allclose(result.arrays[name].numpy(), expected[name].numpy(), rtol=0, atol=1e-6)
    assert result.train_metrics_clientapp[1]["staleness-mean"] == 0.0


def test_a_slow_node_never_holds_a_version_back_and_counts_with_its_staleness() -> None:
    clock = Clock()
    latency = {11: 1.0, 12: 1.0, 13: 5.0}  # node 13 is five times slower
    grid = LatencyGrid({n: _user_app(resources=True) for n in NODES}, latency, clock)  # with resource_mod
    strategy = FedBuff(concurrency=3, buffer=2, uplink="qsgd:bits=4")
    result = _run(strategy, grid, 6, clock)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3, 4, 5, 6]
    # each version's metrics: the costs its two replies' devices reported (taken out of the replies)
    assert all(m["fedge-device-resources.devices"] == 2 for m in result.train_metrics_clientapp.values())
    # six versions of two updates each took about six fast turns, not six slow ones
    assert clock.now < 6 * 5.0
    assert grid.sent.count(13) < grid.sent.count(11)
    assert any(m["staleness-mean"] > 0 for m in result.train_metrics_clientapp.values())
    assert all(np.isfinite(a.numpy()).all() for a in result.arrays.values())
    fp32 = sum(len(a.data) for a in _model().values())
    assert 0 < strategy.uplink_bytes < 12 * fp32 / 7  # 4-bit updates, 12 of them at least
    assert not strategy.refused


def test_stale_updates_are_dropped_and_corrupt_or_failed_ones_refused_with_the_reason() -> None:
    clock = Clock()

    def tamper(node: int, reply: Message) -> None:
        if node == 12:  # a corrupt payload
            payload = bytearray(read_payload(reply.content, UPDATE_RECORD))
            payload[-3] ^= 0xFF
            reply.content[UPDATE_RECORD] = payload_record(bytes(payload))

    grid = LatencyGrid({n: _user_app() for n in NODES}, {11: 1.0, 12: 1.0, 13: 3.5}, clock, tamper=tamper)
    strategy = FedBuff(concurrency=3, buffer=1, uplink="qsgd:bits=4", staleness=Staleness(max_staleness=0))
    result = _run(strategy, grid, 4, clock)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3, 4]
    assert strategy.dropped_stale >= 1  # node 13's updates arrive versions late
    assert {node for _, node, _ in strategy.refused} == {12}
    assert all("checksum mismatch" in reason for _, _, reason in strategy.refused)
    counted: dict[str, float] = {}  # each version's train metrics count its failures by kind, as layered() does
    for metrics in result.train_metrics_clientapp.values():
        for name, value in metrics.items():
            if name.startswith("fedge-failed."):
                counted[name] = counted.get(name, 0) + value
    assert counted.pop("fedge-failed.stale") == strategy.dropped_stale
    assert sum(counted.values()) == len(strategy.refused) and set(counted) == {"fedge-failed.invalid"}


def test_fedasync_mixes_every_update_in_and_refuses_bad_parameters() -> None:
    clock = Clock()
    grid = LatencyGrid({n: _user_app() for n in NODES}, {11: 1.0, 12: 2.0, 13: 3.0}, clock)
    result = _run(FedAsync(concurrency=3, alpha=0.5), grid, 5, clock)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="alpha"):
        FedAsync(alpha=1.5)
    with pytest.raises(ValueError, match="concurrency"):
        FedBuff(concurrency=0)
    with pytest.raises(ValueError, match="uplink codec"):
        FedBuff(uplink="nonsense")


def test_the_buffer_is_the_engines_aggregation_rule_and_a_robust_one_resists_a_bad_update() -> None:
    """``aggregator=`` names one of the engine's rules: the streaming mean by default, or a robust
    one; with the coordinate-wise median one node's huge (finite) update cannot drag the version."""
    def boost(node: int, reply: Message) -> None:
        if node == 13:
            from fedge.protocol.layout import Layout

            arrays = reply.content.array_records["arrays"]
            flat = Layout(arrays).flatten(arrays) + 1e3
            reply.content["arrays"] = Layout(arrays).rebuild(flat.astype(np.float32), arrays)

    start = _model()
    norms = {}
    for rule in ("mean", "median"):
        clock = Clock()
        grid = LatencyGrid({n: _user_app(with_mod=False) for n in NODES}, {n: 1.0 for n in NODES}, clock, boost)
        result = _run(FedBuff(concurrency=3, buffer=3, uplink=None, aggregator=rule), grid, 1, clock, start)
        norms[rule] = max(float(np.abs(result.arrays[k].numpy() - start[k].numpy()).max()) for k in start)
    assert norms["mean"] > 100 and norms["median"] < 10, norms
    with pytest.raises(ValueError, match="aggregator"):
        FedBuff(aggregator="nonsense")


def test_it_waits_for_nodes_that_connect_late_and_times_out_without_any() -> None:
    """A ServerApp may start before its SuperNodes connect: FedBuff waits for a node (on the run's
    clock) instead of ending the run, and gives up at ``timeout`` if none ever comes."""
    clock = Clock()
    grid = LatencyGrid({n: _user_app() for n in NODES}, {n: 1.0 for n in NODES}, clock)
    connected = grid.get_node_ids
    grid.get_node_ids = lambda: connected() if clock() >= 5.0 else []  # type: ignore[method-assign]
    result = _run(FedBuff(concurrency=3, buffer=3), grid, 2, clock)
    assert sorted(result.train_metrics_clientapp) == [1, 2] and min(grid.sent) in NODES
    nobody = LatencyGrid({}, {}, Clock())
    with pytest.raises(TimeoutError, match="0 of 2 versions within 30 s"):
        FedBuff(concurrency=3, buffer=3).start(nobody, _model(), 2, timeout=30, clock=nobody.clock,
                                               sleep=nobody.clock.sleep)


def test_the_servers_evaluate_fn_runs_for_every_version() -> None:
    clock = Clock()
    grid = LatencyGrid({n: _user_app() for n in NODES}, {n: 1.0 for n in NODES}, clock)
    seen: list[int] = []

    def evaluate(version: int, arrays: ArrayRecord) -> MetricRecord:
        seen.append(version)
        return MetricRecord({"norm": float(sum(np.abs(a.numpy()).sum() for a in arrays.values()))})

    result = FedBuff(concurrency=3, buffer=3).start(grid, _model(), 3, evaluate_fn=evaluate, clock=clock,
                                                    sleep=clock.sleep)
    assert seen == [0, 1, 2, 3] and sorted(result.evaluate_metrics_serverapp) == [0, 1, 2, 3]


# ---- the lattice downlink -----------------------------------------------------------------------


def test_with_the_lattice_downlink_nodes_train_from_the_public_copy_and_a_slow_one_catches_up(monkeypatch) -> None:
    """Every message brings its node's copy to the current public version, bit for bit what the
    server holds for it; the slow node, versions behind when it returns, gets a catch-up (not the
    model); the downlink costs a fraction of fp32 and the run refuses nothing."""
    import fedge.flower.fedbuff as fedbuff_module
    from fedge.coordinator.downlink_layer import DownlinkLayer
    from fedge.protocol.records import DOWNLINK_RECORD

    sent: dict[int, list[np.ndarray]] = {}
    kinds: dict[int, list[str]] = {}

    class Recording(DownlinkLayer):
        def outgoing(self, step, outgoing):  # type: ignore[no-untyped-def]
            super().outgoing(step, outgoing)
            for o in outgoing:  # what each message brought (asked again: the same message, its node unconfirmed)
                sent.setdefault(o.node, []).append(self.broadcast.public.numpy().copy())
                kinds.setdefault(o.node, []).append(self.broadcast.message_for(o.node).kind)

    monkeypatch.setattr(fedbuff_module, "DownlinkLayer", Recording)
    clock, seen = Clock(), {}
    latency = {11: 1.0, 12: 1.0, 13: 5.0}
    pushed: list[bool] = []  # each message as it left: the lattice record, no fp32 model
    grid = LatencyGrid({n: _user_app(seen=seen) for n in NODES}, latency, clock)
    push = grid.push_messages

    def push_and_check(messages):  # type: ignore[no-untyped-def]
        pushed.extend("arrays" not in m.content and DOWNLINK_RECORD in m.content for m in messages)
        return push(messages)

    grid.push_messages = push_and_check  # type: ignore[method-assign]
    strategy = FedBuff(concurrency=3, buffer=2, uplink="qsgd:bits=4", downlink="lattice:ratio=0.1")
    result = _run(strategy, grid, 8, clock)
    assert sorted(result.train_metrics_clientapp) == list(range(1, 9)) and not strategy.refused
    assert pushed and all(pushed)
    for node in NODES:  # the user's code got the server's public copy, bit for bit
        assert len(seen[node]) == len(sent[node])
        for got, public in zip(seen[node], sent[node], strict=True):
            flat = np.concatenate([got[k].numpy().ravel() for k in got if got[k].numpy().dtype.kind == "f"])
            assert np.array_equal(flat, public)
    assert kinds[13][0] == "snapshot" and "catch-up" in kinds[13][1:]  # back several versions later
    fp32 = sum(len(a.data) for a in _model().values())
    downlink = result.train_metrics_clientapp[8]["fedge-downlink-bytes"]
    assert 0 < downlink < 0.4 * len(pushed) * fp32, (downlink, len(pushed) * fp32)
    assert all(np.isfinite(a.numpy()).all() for a in result.arrays.values())


def test_fedbuff_refuses_an_unknown_downlink_when_built() -> None:
    with pytest.raises(ValueError, match="downlink codec"):
        FedBuff(downlink="lattice:ratio=2")


@pytest.mark.parametrize("make", [lambda **kw: FedBuff(concurrency=3, buffer=2, **kw),
                                  lambda **kw: FedAsync(concurrency=3, alpha=0.6, **kw)], ids=["FedBuff", "FedAsync"])
def test_a_tcs_uplink_decodes_each_reply_on_the_support_its_nodes_change_moved(monkeypatch, make) -> None:
    """``tcs`` with the lattice downlink, as the engine's FedBuff runs it: each node encodes on the
    coordinates the change its message brought moved (none after a snapshot), and the strategy
    decodes each reply on that node's support. Here the support is found independently, as where
    the node's public copy moved between its messages, and this test decodes every reply on it
    again: the same update, bit for bit, with extras outside the support. Without a lattice
    downlink there is no support, and ``tcs`` is refused when the strategy is built."""
    import fedge.flower.fedbuff as fedbuff_module
    from fedge.compression import make_codec
    from fedge.coordinator.downlink_layer import DownlinkLayer

    spec = "tcs:extra=0.01,sample=0+qsgd:bits=4"
    with pytest.raises(ValueError, match="needs a lattice downlink"):
        FedBuff(uplink=spec)
    expected: dict[int, list[np.ndarray]] = {}
    held: dict[int, np.ndarray] = {}

    class Recording(DownlinkLayer):
        def outgoing(self, step, outgoing):  # type: ignore[no-untyped-def]
            super().outgoing(step, outgoing)
            public = self.broadcast.public.numpy().copy()
            for o in outgoing:  # asked again: the same message, its node unconfirmed
                snapshot = self.broadcast.message_for(o.node).kind == "snapshot"
                before = held.get(o.node)
                moved = np.zeros(0, np.int64) if snapshot or before is None else np.flatnonzero(public != before)
                expected.setdefault(o.node, []).append(moved)
                held[o.node] = public

    decoded: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    original = fedbuff_module.reply_through_layers

    def recording(layers, step, message, reply, layout, wire, sent, key, admit):  # type: ignore[no-untyped-def]
        support = expected[reply.node].pop(0)  # one message in flight per node: its replies come in order
        out = original(layers, step, message, reply, layout, wire, sent, key, admit)
        mine = make_codec(spec).for_model(layout.sizes()).for_round(reply.started + 1, strategy.seed)
        decoded.append((support, mine.with_support(support).decode(read_payload(message.content, UPDATE_RECORD),
                                                                   layout.numel).numpy(), out[1].vector.numpy()))
        return out

    monkeypatch.setattr(fedbuff_module, "DownlinkLayer", Recording)
    monkeypatch.setattr(fedbuff_module, "reply_through_layers", recording)
    clock = Clock()
    grid = LatencyGrid({n: _user_app() for n in NODES}, {11: 1.0, 12: 1.0, 13: 5.0}, clock)
    strategy = make(uplink=spec, downlink="lattice:ratio=0.1")
    result = _run(strategy, grid, 8, clock)
    assert sorted(result.train_metrics_clientapp) == list(range(1, 9)) and not strategy.refused
    assert sum(1 for support, _, _ in decoded if support.size) >= 4  # changes, not only first snapshots
    for support, mine, theirs in decoded:
        np.testing.assert_array_equal(mine, theirs)
        assert set(np.flatnonzero(mine).tolist()) - set(support.tolist())  # the extras, outside it


@pytest.mark.parametrize("make", [lambda **kw: FedBuff(concurrency=3, buffer=2, **kw),
                                  lambda **kw: FedAsync(concurrency=3, alpha=0.6, **kw)], ids=["FedBuff", "FedAsync"])
def test_the_engines_layers_run_around_fedbuff_in_a_flower_app(make) -> None:
    """A layer written for the engine (its test layer, and the update guard) runs in ``FedBuff``'s
    asynchronous rounds as in the engine's: it sees every reply that arrives, bounds each update
    before it is buffered, and reports on each version in its train metrics. A layer that works on
    a whole round's sum is refused when the strategy is built."""
    from fedge.aggregation.partial import Partial
    from fedge.coordinator.layer import Layer
    from fedge.coordinator.update_guard import UpdateGuard
    from tests.server.test_layers import CountingLayer

    class _Sum(Layer):
        key = "test-sum"
        provides = frozenset({"sum"})

        def release(self, step, partial: Partial) -> Partial:  # type: ignore[no-untyped-def]
            return partial

    with pytest.raises(ValueError, match="whole round"):
        make(layers=[_Sum()])
    clock = Clock()
    grid = LatencyGrid({n: _user_app() for n in NODES}, {11: 1.0, 12: 1.0, 13: 2.5}, clock)
    counting = CountingLayer()
    guard = UpdateGuard("clip:max=0.05", "none")
    strategy, start = make(uplink="qsgd:bits=4", layers=[counting, guard]), _model()
    result = _run(strategy, grid, 5, clock, start)
    metrics = result.train_metrics_clientapp
    assert sorted(metrics) == [1, 2, 3, 4, 5] and not strategy.refused
    assert [metrics[v]["test_counter.total"] for v in (1, 2, 3, 4, 5)] == \
        list(np.cumsum([metrics[v]["test_counter.step"] for v in (1, 2, 3, 4, 5)]))
    assert counting.total == len(grid.sent) - len(strategy.refused) - sum(
        1 for mid in grid.waiting)  # every reply that arrived, none that is still in flight
    # every buffered update was clipped to norm 0.05 (the user's updates are far larger), so five
    # versions move the model by at most 5 x 0.05
    moved = np.concatenate([(result.arrays[k].numpy() - start[k].numpy()).ravel() for k in start.keys()])
    assert 0 < np.linalg.norm(moved) <= 5 * 0.05 + 1e-4
    assert sum(metrics[v]["clipped"] for v in metrics) >= 5


def test_a_clientapp_written_for_flowers_strategies_reads_the_round_it_trains_for() -> None:
    """Flower's strategies put ``server-round`` in every train config and apps read it (the example
    app seeds its shuffles with it): FedBuff's messages carry it too, the version + 1 they train for.
    Without it every reply was an error and the versions never came (bench/flower_stragglers.py)."""
    seen: list[int] = []
    base = _user_app()

    def app(msg, context):  # type: ignore[no-untyped-def]
        seen.append(int(msg.content["config"]["server-round"]))  # KeyError before
        return base(msg, context)

    clock = Clock()
    grid = LatencyGrid({n: app for n in NODES}, {n: 1.0 for n in NODES}, clock)
    result = _run(FedBuff(concurrency=3, buffer=3), grid, 2, clock)
    assert sorted(result.train_metrics_clientapp) == [1, 2] and set(seen) == {1, 2}

