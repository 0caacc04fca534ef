"""One layer class, both coordinators: a layer written for Fedge's engine (the test layer of
``tests/server/test_layers.py``, registered there with one call) runs unchanged around a Flower
strategy through ``fedge.flower.layered``, and what its hooks do to the updates and the released
sum is what the strategy aggregates."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fedge.aggregation.partial import Partial
from fedge.flower import compressed, layered
from fedge.coordinator.layer import Layer
from fedge.coordinator.step import Step, Update
from fedge.protocol.failures import Failure, Rejected
from tests.flower.test_compressed_strategy import (  # noqa: F401
    NODES,
    Grid,
    _contexts,
    _copy,
    _exchange,
    _flat,
    _model,
    _user_app,
)
from tests.server.test_layers import CountingLayer


class _Halving(Layer):
    """Halves every update on its way to the aggregate (the ``update`` hook)."""

    key = "test-halving"

    def update(self, step: Step, update: Update) -> Update:
        return dataclasses.replace(update, vector=update.vector * 0.5)


class _Frozen(Layer):
    """Releases a zero mean in place of the clear sum (the ``release`` hook): the model stays."""

    key = "test-frozen"

    def release(self, step: Step, partial: Partial) -> Partial:
        return Partial.of_mean(torch.zeros(partial.numel), partial.weight, partial.count, members=partial.members)


def _rounds(strategy, arrays, rounds: int = 2):  # type: ignore[no-untyped-def]
    """``rounds`` train rounds of ``strategy`` in-process from ``arrays``: (arrays, metrics) of each."""
    apps, contexts, out = {n: _user_app(with_mod=False) for n in NODES}, _contexts(), []
    for server_round in range(1, rounds + 1):
        replies = _exchange(list(strategy.configure_train(server_round, arrays, ConfigRecord({}), Grid())), apps,
                            contexts)
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        out.append((arrays, metrics))
    return out


def test_the_engines_test_layer_runs_in_a_flower_app_and_changes_nothing_it_should_not() -> None:
    arrays, apps, contexts = _model(), {n: _user_app(with_mod=False) for n in NODES}, _contexts()
    plain, wrapped = FedAvg(), layered(FedAvg(), CountingLayer())
    for server_round in (1, 2):
        list(plain.configure_train(server_round, arrays, ConfigRecord({}), Grid()))
        replies = _exchange(list(wrapped.configure_train(server_round, arrays, ConfigRecord({}), Grid())), apps,
                            contexts)
        expected, _ = plain.aggregate_train(server_round, _copy(replies))
        got, metrics = wrapped.aggregate_train(server_round, replies)
        for name in expected:  # a layer that only counts leaves FedAvg's aggregate bit for bit
            assert np.array_equal(got[name].numpy(), expected[name].numpy()), name
        assert (metrics["test_counter.step"], metrics["test_counter.total"]) == (3, 3 * server_round)
        arrays = got


def test_what_a_layer_makes_of_the_updates_and_the_sum_is_what_the_strategy_aggregates() -> None:
    model = _model()
    start = _flat(model)
    (plain, _), = _rounds(FedAvg(), model, rounds=1)
    (halved, _), = _rounds(layered(FedAvg(), _Halving()), model, rounds=1)
    np.testing.assert_allclose(_flat(halved) - start, 0.5 * (_flat(plain) - start), rtol=0, atol=1e-6)
    (frozen, _), = _rounds(layered(FedAvg(), _Frozen()), model, rounds=1)
    np.testing.assert_array_equal(_flat(frozen), start)


def test_layered_and_compressed_merge_either_way_and_layers_in_an_order_that_cannot_work_are_refused() -> None:
    one, other = layered(compressed(FedAvg(), downlink="lattice"), CountingLayer()), \
        compressed(layered(FedAvg(), CountingLayer()), downlink="lattice")
    for wrapped in (one, other):  # one round: the strategy itself, the counting and the downlink layer
        assert type(wrapped.strategy) is FedAvg and wrapped.uplink == "qsgd:bits=4"
        assert [layer.key for layer in wrapped.layers] == ["downlink", CountingLayer.key]
    with pytest.raises(ValueError, match="compressed"):
        compressed(compressed(FedAvg()))

    class _Twice(CountingLayer):
        provides = frozenset({"sum"})

    class _Again(CountingLayer):
        key = "test-again"
        provides = frozenset({"sum"})

    with pytest.raises(ValueError, match="both provide the step's 'sum'"):
        layered(FedAvg(), _Twice(), _Again())


class _RefusesNode12(Layer):
    """Refuses node 12's update in its ``update`` hook, as the engine's update guard refuses one."""

    key = "test-refuses"

    def update(self, step: Step, update: Update) -> Update:
        if update.node == 12:
            raise Rejected("node 12's update is out of bounds")
        return update


def test_a_reply_a_layer_refuses_or_that_holds_nan_is_left_out_with_its_reason_and_the_round_goes_on() -> None:
    model, apps, contexts = _model(), {n: _user_app(with_mod=False) for n in NODES}, _contexts()
    wrapped, plain = layered(FedAvg(), _RefusesNode12(), CountingLayer()), FedAvg()
    list(plain.configure_train(1, model, ConfigRecord({}), Grid()))
    replies = _exchange(list(wrapped.configure_train(1, model, ConfigRecord({}), Grid())), apps, contexts)
    poisoned = next(r for r in replies if r.metadata.src_node_id == 13)
    state = poisoned.content["arrays"].to_torch_state_dict()
    poisoned.content["arrays"] = ArrayRecord({k: v * float("nan") if v.is_floating_point() else v
                                              for k, v in state.items()})
    expected, _ = plain.aggregate_train(1, _copy([r for r in replies if r.metadata.src_node_id == 11]))
    got, metrics = wrapped.aggregate_train(1, replies)
    for name in expected:  # only node 11's update is in the aggregate
        assert np.array_equal(got[name].numpy(), expected[name].numpy()), name
    assert metrics["test_counter.step"] == 3  # every reply reached the door


def test_a_devices_typed_refusal_reaches_the_layers_by_its_kind_through_the_one_door() -> None:
    """A Flower app's replies pass the engine's door (``fedge.coordinator.door``): a device's typed
    refusal (``refusal_mod``) reaches every layer's ``missed`` with its own kind, not as an
    undecodable reply; a policy decline is counted apart from the failures, as the engine counts it."""
    from fedge.protocol.failures import FailureKind
    from fedge.protocol.refusals import refusal_content

    class _Heard(Layer):
        key = "test-heard"

        def __init__(self) -> None:
            self.kinds: dict[int, FailureKind] = {}

        def arrived(self, step: Step, event) -> bool:  # type: ignore[no-untyped-def]
            if isinstance(event, Failure):
                self.kinds[event.node] = event.kind
            return False

    model, apps, contexts = _model(), {n: _user_app(with_mod=False) for n in NODES}, _contexts()
    heard, plain = _Heard(), FedAvg()
    wrapped = layered(FedAvg(), heard)
    list(plain.configure_train(1, model, ConfigRecord({}), Grid()))
    replies = _exchange(list(wrapped.configure_train(1, model, ConfigRecord({}), Grid())), apps, contexts)
    expected, _ = plain.aggregate_train(1, _copy([r for r in replies if r.metadata.src_node_id == 11]))
    for reply in replies:
        if reply.metadata.src_node_id == 12:
            reply.content = refusal_content(FailureKind.OUT_OF_SYNC, "copy at version 3, message for 4")
        elif reply.metadata.src_node_id == 13:
            reply.content = refusal_content(FailureKind.NOT_ELIGIBLE, "trains only while charging")
    got, metrics = wrapped.aggregate_train(1, replies)
    for name in expected:  # node 11's update alone
        assert np.array_equal(got[name].numpy(), expected[name].numpy()), name
    assert heard.kinds == {12: FailureKind.OUT_OF_SYNC, 13: FailureKind.NOT_ELIGIBLE}
    assert metrics["fedge-failed.out-of-sync"] == 1 and metrics["fedge-declined.not-eligible"] == 1
    assert "fedge-failed.not-eligible" not in metrics and "fedge-failed.invalid" not in metrics


def test_the_engines_model_average_runs_in_a_flower_app_and_leaves_training_alone() -> None:
    """The model average, one class (``ModelAverageLayer`` over ``fedge.aggregation.model_average``)
    in both coordinators: around a Flower strategy it folds each round's model into the moving
    average as the engine folds each published model (the same bytes as the engine's average of the
    same models), while the strategy keeps training from its own latest model, not the average."""
    from fedge.aggregation.model_average import ModelAverage
    from fedge.coordinator.model_average_layer import ModelAverageLayer

    layer = ModelAverageLayer(ModelAverage(0.5))
    rounds = _rounds(layered(FedAvg(), layer), _model(), rounds=3)
    engine = ModelAverage(0.5)  # what the engine's layer holds after the same published models
    for arrays, _ in rounds:
        expected = engine.update(torch.from_numpy(_flat(arrays)))
    last = torch.from_numpy(_flat(rounds[-1][0]))
    delivered = layer.delivered(last)
    assert torch.equal(delivered, expected) and not torch.equal(delivered, last)
    assert layer.state_dict()["count"] == 3


def test_a_strategy_that_returns_other_dtypes_than_it_was_sent_runs_layered() -> None:
    """FedAdam aggregates into float64 arrays from the float32 model it was sent: the layers' round
    closes on what it returned (the outcome's model used to be flattened with the sent model's
    layout, which refused the new dtypes)."""
    from flwr.serverapp.strategy import FedAdam

    (arrays, metrics), = _rounds(layered(FedAdam(eta=0.01, tau=0.1), CountingLayer()), _model(), rounds=1)
    assert arrays is not None and metrics["test_counter.step"] == len(NODES)


def test_the_engines_update_guard_runs_in_a_flower_app_and_clips_caps_and_refuses_as_there() -> None:
    """The update guard, one class in both coordinators: around FedAvg it clips each update to the
    norm bound and caps each claimed example count before the strategy aggregates (FedAvg of the
    guarded updates, computed here from the same replies), says so in the round's metrics, and in
    reject mode leaves an update over the bound out, with its reason."""
    from fedge.coordinator.update_guard import UpdateGuard

    model, limit, cap = _model(), 3.0, 25
    start = _flat(model)
    apps, contexts = {n: _user_app(with_mod=False) for n in NODES}, _contexts()
    replies = _exchange(list(FedAvg().configure_train(1, model, ConfigRecord({}), Grid())), apps, contexts)
    deltas = {r.metadata.src_node_id: _flat(r.content["arrays"]) - start for r in replies}
    examples = {r.metadata.src_node_id: float(r.content["metrics"]["num-examples"]) for r in replies}
    norms = {n: float(np.linalg.norm(d)) for n, d in deltas.items()}
    assert sum(norm > limit for norm in norms.values()) >= 1 and max(examples.values()) > cap  # both bite

    guard = UpdateGuard(f"clip:max={limit:g}", f"fixed:max={cap}")
    (got, metrics), = _rounds(layered(FedAvg(), guard), model, rounds=1)
    clipped = {n: d * min(1.0, limit / norms[n]) for n, d in deltas.items()}
    weights = {n: min(examples[n], cap) for n in deltas}
    expected = start + sum(weights[n] * clipped[n] for n in deltas) / sum(weights.values())
    np.testing.assert_allclose(_flat(got), expected, rtol=0, atol=1e-6)
    assert metrics["clipped"] == sum(norm > limit for norm in norms.values()) and metrics["weight_capped"] >= 1

    rejecting = layered(FedAvg(), UpdateGuard(f"reject:max={limit:g}"))
    (kept, _), = _rounds(rejecting, model, rounds=1)
    over = sorted(n for n in NODES if norms[n] > limit)
    assert sorted(node for _, node, _ in rejecting.refused) == over
    inside = [n for n in NODES if n not in over]
    mean = sum(examples[n] * deltas[n] for n in inside) / sum(examples[n] for n in inside)
    np.testing.assert_allclose(_flat(kept), start + mean, rtol=0, atol=1e-6)


def test_oort_runs_in_a_flower_app_timing_each_reply_by_the_messages_own_timestamps() -> None:
    """The engine's selection layer with Oort's rule around FedAvg: a Flower strategy sees its
    replies only after the round's barrier, so each reply is timed by its own ``created_at`` against
    its message's (what Flower's TTL check reads). Four of eight nodes take 10x longer; Oort learns
    each node's time from the timestamps, asks the fast ones far more often, and its ``min-share``
    keeps asking the slow ones now and then. A node that does not answer costs it the whole wait."""
    from collections import Counter

    from flwr.app import Context, RecordDict

    from fedge.coordinator.selection_layer import Oort, SelectionLayer

    nodes, slow = list(range(21, 29)), {25, 26, 27, 28}

    class _Grid:
        def get_node_ids(self) -> list[int]:
            return list(nodes)

    apps = {n: _user_app(with_mod=False) for n in nodes}
    contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={}) for n in nodes}
    now = [0.0]  # the coordinator's clock: times a node that never answers
    layer = SelectionLayer(Oort(explore=0.25, min_share=0.25), seed=0, per_step=4, clock=lambda: now[0])
    wrapped, arrays, asked = layered(FedAvg(fraction_train=0.5), layer), _model(), Counter()
    for server_round in range(1, 13):
        messages = list(wrapped.configure_train(server_round, arrays, ConfigRecord({}), _Grid()))
        assert len(messages) == 4
        sent = {m.metadata.dst_node_id: m.metadata.created_at for m in messages}
        asked.update(sent)
        replies = _exchange(messages, apps, contexts)
        for reply in replies:  # as if each node had taken this long (the slow ones 20 s, the others 2 s)
            node = reply.metadata.src_node_id
            reply.metadata.created_at = sent[node] + (20.0 if node in slow else 2.0)
        arrays, metrics = wrapped.aggregate_train(server_round, replies)
        assert arrays is not None
    assert layer.devices[21].duration == pytest.approx(2.0, abs=0.5)
    assert layer.devices[25].duration == pytest.approx(20.0, abs=0.5)
    fast_asks, slow_asks = sum(asked[n] for n in nodes if n not in slow), sum(asked[n] for n in slow)
    assert fast_asks > 2 * slow_asks and all(asked[n] >= 1 for n in nodes), asked
    assert metrics["participation.min"] >= 1 and metrics["participation.devices"] == 8
    # a node that never answers is timed at the whole wait, as the engine's timeout
    messages = list(wrapped.configure_train(13, arrays, ConfigRecord({}), _Grid()))
    gone = messages[0].metadata.dst_node_id
    replies = [r for r in _exchange(messages, apps, contexts) if r.metadata.src_node_id != gone]
    before = layer.devices[gone].duration
    now[0] += 60.0  # the round waited a minute for it
    _, metrics = wrapped.aggregate_train(13, replies)
    assert layer.devices[gone].duration == pytest.approx(0.5 * before + 0.5 * 60.0)  # smoothing 0.5
    assert metrics["fedge-failed.timeout"] == 1 and not wrapped.refused  # counted by kind; no reply was refused


def test_the_engines_central_dp_runs_in_a_flower_app_and_releases_the_clipped_sum_plus_its_noise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Central DP, one class in both coordinators: around FedAvg the engine's DP layer samples every
    node (q = clients-per-round over the connected nodes = 1), clips each update to C, weighs every
    device 1 and releases (sum of clipped updates + N(0, (zC)^2)) / (q N), the noise drawn from a
    generator seeded by the OS CSPRNG (here a fixed stand-in, so the noise is reproduced exactly).
    The round's train metrics carry the ledger's epsilon and no training loss; the run stops before
    a round would spend more than the budget; a strategy that ranks its updates is refused."""
    from flwr.serverapp.strategy import FedMedian

    from fedge.coordinator import dp_mechanisms as dp_layer
    from fedge.coordinator.dp_layer import DifferentialPrivacyLayer

    seed = bytes(range(16))
    monkeypatch.setattr(dp_layer, "_os_entropy", lambda n: seed[:n])
    noise, clip, budget = 0.5, 1.0, 22.0  # three rounds: epsilon 10.0, 15.5, 20.1, then 24.4
    layer = DifferentialPrivacyLayer.central(f"gaussian:noise={noise},clip={clip},delta=1e-5,budget={budget}",
                                                      clients_per_round=len(NODES))
    model, apps, contexts = _model(), {n: _user_app(with_mod=False) for n in NODES}, _contexts()
    start = _flat(model)
    wrapped = layered(FedAvg(fraction_train=0.5), layer)  # the layer's Poisson sample replaces FedAvg's
    messages = list(wrapped.configure_train(1, model, ConfigRecord({}), Grid()))
    assert sorted(m.metadata.dst_node_id for m in messages) == NODES
    assert all(m.content["config"]["dp-clip"] == clip for m in messages)  # what a Fedge device clips to
    replies = _exchange(messages, apps, contexts)
    deltas = [_flat(r.content["arrays"]) - start for r in replies]
    assert max(float(np.linalg.norm(d)) for d in deltas) > clip  # the clip bites
    got, metrics = wrapped.aggregate_train(1, replies)
    clipped = sum(d * min(1.0, clip / float(np.linalg.norm(d))) for d in deltas)
    drawn = np.random.default_rng(int.from_bytes(seed, "little")).normal(0.0, noise * clip, size=start.size)
    expected = start + (clipped + drawn.astype(np.float32)) / len(NODES)
    np.testing.assert_allclose(_flat(got), expected, rtol=0, atol=1e-5)
    assert metrics["dp_epsilon"] > 0 and metrics["dp_sampling_rate"] == 1.0 and "train_loss" not in metrics
    rounds = 1
    while messages := list(wrapped.configure_train(rounds + 1, got, ConfigRecord({}), Grid())):  # until the budget
        rounds += 1
        got, _ = wrapped.aggregate_train(rounds, _exchange(messages, apps, contexts))
        assert rounds < 4
    assert len(layer.mechanism.ledger.rounds) == rounds and layer.mechanism.ledger.epsilon_pld() <= budget
    assert layer.mechanism.ledger.would_exceed(budget, 1.0, noise)
    with pytest.raises(ValueError, match="FedMedian aggregates each update itself"):
        layered(FedMedian(), DifferentialPrivacyLayer.central("gaussian:noise=1,clip=1", clients_per_round=2))


class _KeepsBack(Layer):
    """Keeps back the message of one node when its step's messages go out (the ``outgoing`` hook), as
    secure aggregation keeps back those of the devices that dealt no shares."""

    key = "test-keeps-back"

    def __init__(self, node: int) -> None:
        self.node = node

    def outgoing(self, step, outgoing) -> None:  # type: ignore[no-untyped-def]
        outgoing[:] = [o for o in outgoing if o.node != self.node]


def test_a_message_a_layer_keeps_back_is_not_sent_and_the_round_aggregates_the_others() -> None:
    """A layer's ``outgoing`` may keep messages back: the wrapper sends only those it let go (with the
    layers' writes), and the round is FedAvg's over the other nodes' updates."""
    arrays, apps, contexts = _model(), {n: _user_app(with_mod=False) for n in NODES}, _contexts()
    held = NODES[0]
    wrapped = layered(FedAvg(), _KeepsBack(held), CountingLayer())
    messages = list(wrapped.configure_train(1, arrays, ConfigRecord({}), Grid()))
    assert sorted(m.metadata.dst_node_id for m in messages) == sorted(n for n in NODES if n != held)
    replies = _exchange(messages, apps, contexts)
    plain = FedAvg()
    list(plain.configure_train(1, arrays, ConfigRecord({}), Grid()))
    expected, _ = plain.aggregate_train(1, _copy(replies))
    got, metrics = wrapped.aggregate_train(1, replies)
    for name in expected:
        assert np.array_equal(got[name].numpy(), expected[name].numpy()), name
    assert metrics["test_counter.step"] == len(NODES) - 1 and "fedge-failed.timeout" not in metrics


def test_the_devices_resource_reports_reach_the_round_metrics_and_not_the_strategy() -> None:
    """``resource_mod`` on a Flower app's ClientApp adds a second MetricRecord to each reply, which
    Flower's FedAvg refuses to aggregate: the wrapper counts it in the round's tally (as the engine
    counts it for its row) and takes it out, and the train metrics gain the devices' costs, the
    median and 95th percentile of each field over the replies."""
    model, contexts = _model(), _contexts()
    wrapped = compressed(FedAvg(), uplink="qsgd:bits=4")
    apps = {n: _user_app(resources=True) for n in NODES}
    replies = _exchange(list(wrapped.configure_train(1, model, ConfigRecord({}), Grid())), apps, contexts)
    assert all(set(r.content.metric_records) == {"metrics", "resources"} for r in replies)
    plain = FedAvg()
    list(plain.configure_train(1, model, ConfigRecord({}), Grid()))
    from flwr.serverapp.exception import InconsistentMessageReplies

    with pytest.raises(InconsistentMessageReplies, match="exactly one MetricRecord"):  # what the wrapper spares it
        plain.aggregate_train(1, _copy(replies))
    arrays, metrics = wrapped.aggregate_train(1, replies)
    assert arrays is not None and metrics["fedge-uplink-bytes"] > 0
    resources = {k.removeprefix("fedge-device-resources."): v for k, v in metrics.items()
                 if k.startswith("fedge-device-resources.")}
    assert resources["devices"] == len(NODES)
    assert resources["cpu_seconds.p95"] >= resources["cpu_seconds.median"] > 0
    assert resources["bytes_up.median"] > 0 and resources["peak_rss_mib.median"] > 0


def test_a_layer_bug_is_not_taken_for_a_refused_reply() -> None:
    """A layer that raises anything but the door's refusals (``Rejected``, ``PayloadError``,
    ``ProtocolError``) has a bug: it propagates, in a Flower app as in the engine, instead of
    leaving the reply out as if the device had sent a bad one."""

    class _Buggy(Layer):
        key = "test-buggy"

        def update(self, step: Step, update: Update) -> Update:
            return {}["missing"]  # type: ignore[return-value]

    model, apps, contexts = _model(), {n: _user_app(with_mod=False) for n in NODES}, _contexts()
    wrapped = layered(FedAvg(), _Buggy())
    replies = _exchange(list(wrapped.configure_train(1, model, ConfigRecord({}), Grid())), apps, contexts)
    with pytest.raises(KeyError):
        wrapped.aggregate_train(1, replies)
