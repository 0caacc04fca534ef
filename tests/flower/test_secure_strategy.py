"""``fedge.flower.secure`` and ``secure_mod``: a user's strategy over Fedge's secure aggregation,
message by message in-process (an in-process grid stand-in routes each message to the node's
ClientApp; the real engines run it in tests/integration/test_flower_app.py). The wrapped aggregate
is the plain strategy's on the survivors' updates up to the shared grid's rounding, a node that
drops after dealing its shares leaves an exact sum of the others, what the coordinator receives
says nothing in clear, and strategies that need each update are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedMedian, FedProx, FedYogi, Krum

from fedge.flower import compressed, secure, secure_mod
from fedge.protocol.records import UPDATE_RECORD, payload_record, read_payload
from fedge.protocol.refusals import PolicyRefusal
from fedge.protocol.secagg import SECAGG_RECORD, plan_from_record
from fedge.tasks import make_task
from tests.flower.test_compressed_strategy import _flat  # the float arrays, flattened in the record's order

NODES = [11, 12, 13, 14]
SPEC = "secagg:bits=12,clip=0.5,weight-cap=64"
STEP, CAP = 2 * 0.5 / (2**12 - 1), 64  # the shared grid's spacing, and the weight cap


def _update(node: int, server_round: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(node * 1000 + server_round)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g).clamp(-4, 4) if v.is_floating_point() else v
            for k, v in state.items()}


def _examples(node: int) -> int:
    return 5 * (node - 10)


def _user_app(calls: list[int], mods: tuple = (secure_mod,)) -> ClientApp:  # type: ignore[type-arg]
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, context: Context) -> Message:  # a user's body: weights in, weights out
        calls.append(context.node_id)
        state = msg.content["arrays"].to_torch_state_dict()
        trained = _update(context.node_id, int(msg.metadata.group_id or 0), state)
        return Message(RecordDict({"arrays": ArrayRecord(trained),
                                   "metrics": MetricRecord({"num-examples": _examples(context.node_id),
                                                            "train_loss": 1.0})}), reply_to=msg)

    return app


class Grid:
    """A grid stand-in: the connected nodes, and each message run by its node's ClientApp in turn.
    ``lost``: nodes whose replies never come (after they dealt their shares: the hard case);
    ``tamper``: a function applied to the replies of the masked round."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.apps = {n: _user_app(self.calls) for n in NODES}
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
                         for n in NODES}
        self.lost: set[int] = set()
        self.tamper = None
        self.seen: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(NODES)

    def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            message.metadata.__dict__["_message_id"] = message.object_id
            masked = plan_from_record(message.content.config_records[SECAGG_RECORD])[1] == "masked"
            if node in self.lost and masked:
                continue
            reply = self.apps[node](message, self.contexts[node])
            reply.metadata.__dict__["_src_node_id"] = node
            if masked and self.tamper is not None:
                reply = self.tamper(reply)
            self.seen.append(reply)
            replies.append(reply)
        return replies

    # the exchanges a step runs itself (secure aggregation's stages) push and pull, as on Flower's Grid
    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        self.pulled = {reply.metadata.reply_to_message_id: reply for reply in self.send_and_receive(messages)}
        return [m.object_id for m in messages]

    def pull_messages(self, ids):  # type: ignore[no-untyped-def]
        return [self.pulled.pop(i) for i in ids if i in self.pulled]


def _model() -> ArrayRecord:
    torch.manual_seed(0)
    return ArrayRecord(make_task("digits").build_model().state_dict())


def _plain_mean(arrays: ArrayRecord, server_round: int, nodes: list[int]) -> dict[str, np.ndarray]:
    """FedAvg's weighted mean of the nodes' trained models, computed here from the user's own updates."""
    state = arrays.to_torch_state_dict()
    total = sum(_examples(n) for n in nodes)
    return {k: sum(_update(n, server_round, state)[k].numpy().astype(np.float64) * _examples(n) for n in nodes) / total
            for k in state}


def _bound(nodes: list[int], carried: bool = False) -> float:
    """How far the revealed weighted mean may be from the plain one: each node rounds w/CAP times its
    update by at most one STEP, so by STEP CAP / w in its update's units, which weighs w / sum(w) in
    the mean; a round after the first also carries each node's previous rounding (error feedback)."""
    return (2 if carried else 1) * len(nodes) * STEP * CAP / sum(_examples(n) for n in nodes) + 1e-6


def _run_round(strategy, grid: Grid, arrays: ArrayRecord, server_round: int):  # type: ignore[no-untyped-def]
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord({"lr": 0.1}), grid))
    for m in messages:
        m.metadata.__dict__["_group_id"] = str(server_round)
    replies = grid.send_and_receive(messages)
    return messages, replies, strategy.aggregate_train(server_round, replies)


@pytest.mark.parametrize("make", [lambda: FedAvg(), lambda: FedProx(proximal_mu=0.1)], ids=["FedAvg", "FedProx"])
def test_the_wrapped_aggregate_is_the_plain_mean_up_to_the_grids_rounding(make) -> None:
    grid, arrays = Grid(), _model()
    wrapped = secure(make(), SPEC)
    for server_round in (1, 2):
        messages, replies, (got, metrics) = _run_round(wrapped, grid, arrays, server_round)
        assert sorted(m.metadata.dst_node_id for m in messages) == NODES
        assert got is not None and metrics["fedge-secagg-survivors"] == len(NODES)
        expected = _plain_mean(arrays, server_round, NODES)
        for name, array in arrays.items():
            if array.numpy().dtype.kind == "f":
                assert np.abs(got[name].numpy() - expected[name]).max() <= _bound(NODES, server_round > 1)
        # the coordinator saw only masked uploads: no arrays, no loss, one example each
        for reply in replies:
            assert set(reply.content.keys()) == {UPDATE_RECORD, "metrics"}
            assert dict(reply.content["metrics"]) == {"num-examples": 1}
        arrays = got


def test_a_node_lost_after_dealing_its_shares_leaves_the_exact_sum_of_the_others() -> None:
    grid, arrays = Grid(), _model()
    grid.lost = {13}
    wrapped = secure(FedAvg(), SPEC)
    _, _, (got, metrics) = _run_round(wrapped, grid, arrays, 1)
    assert metrics["fedge-secagg-survivors"] == 3
    expected = _plain_mean(arrays, 1, [11, 12, 14])
    for name, array in arrays.items():
        if array.numpy().dtype.kind == "f":
            assert np.abs(got[name].numpy() - expected[name]).max() <= _bound([11, 12, 14])


def _truncated(reply: Message) -> None:
    payload = bytes(read_payload(reply.content, UPDATE_RECORD))
    reply.content = RecordDict({UPDATE_RECORD: payload_record(payload[:-5]), "metrics": reply.content["metrics"]})


def _in_clear(reply: Message) -> None:
    reply.content["metrics"] = MetricRecord({"num-examples": 20, "train_loss": 0.5})


@pytest.mark.parametrize("tamper, why", [(_truncated, "malformed masked upload"), (_in_clear, "in clear")],
                         ids=["truncated", "data-in-clear"])
def test_a_bad_masked_reply_is_refused_with_its_reason_and_the_others_unmask(tamper, why) -> None:
    grid, arrays = Grid(), _model()

    def on_node_12(reply: Message) -> Message:
        if reply.metadata.src_node_id == 12:
            tamper(reply)
        return reply

    grid.tamper = on_node_12
    wrapped = secure(FedAvg(), SPEC)
    _, _, (got, metrics) = _run_round(wrapped, grid, arrays, 1)
    assert metrics["fedge-secagg-survivors"] == 3
    assert any(node == 12 and why in reason for _, node, reason in wrapped.refused), wrapped.refused
    expected = _plain_mean(arrays, 1, [11, 13, 14])
    name = next(n for n, a in arrays.items() if a.numpy().dtype.kind == "f")
    assert np.abs(got[name].numpy() - expected[name]).max() <= _bound([11, 13, 14])


@pytest.mark.parametrize("make, lipschitz", [
    (lambda: FedAdam(eta=0.01, tau=0.1), 0.1), (lambda: FedYogi(eta=0.01, tau=0.1), 0.1),
    (lambda: FedAdagrad(eta=0.01, tau=0.1), 0.1), (lambda: FedAvgM(server_momentum=0.9), 1.0)],
    ids=["FedAdam", "FedYogi", "FedAdagrad", "FedAvgM"])
def test_a_server_optimizer_steps_from_the_revealed_mean(make, lipschitz) -> None:
    """The strategy given the one reply (the current model plus the survivors' mean) takes its own
    step from that mean: the same as the plain strategy given a reply built here from the plain mean,
    up to the mean's rounding times how much the step moves with it. The first step of the adaptive
    optimizers, eta_t m / (sqrt(v) + tau), moves at most eta / tau per unit of the mean; FedAvgM's
    (server learning rate 1) at most 1."""
    grid, arrays = Grid(), _model()
    wrapped, plain = secure(make(), SPEC), make()
    _, _, (got, _) = _run_round(wrapped, grid, arrays, 1)
    list(plain.configure_train(1, arrays, ConfigRecord(), grid))
    mean = ArrayRecord({k: Array(v.astype(arrays[k].numpy().dtype)) for k, v in _plain_mean(arrays, 1, NODES).items()})
    one = Message(RecordDict({"arrays": mean, "metrics": MetricRecord({"num-examples": 1})}),
                  reply_to=Message(RecordDict(), dst_node_id=1, message_type="train"))
    expected, _ = plain.aggregate_train(1, [one])
    for name, array in arrays.items():
        if array.numpy().dtype.kind == "f":
            moved = np.abs(expected[name].numpy() - array.numpy()).max()
            assert moved > 0  # the optimizer did step
            assert np.abs(got[name].numpy() - expected[name].numpy()).max() <= lipschitz * _bound(NODES) + 1e-6


@pytest.mark.parametrize("make, why", [(lambda: FedMedian(), "aggregates each update"),
                                       (lambda: Krum(), "aggregates each update"),
                                       (lambda: compressed(FedAvg()), "quantizes each update itself")])
def test_strategies_that_need_each_update_are_refused_when_wrapped(make, why) -> None:
    with pytest.raises(ValueError, match=why):
        secure(make(), SPEC)


def test_without_the_wrapper_the_mod_passes_messages_through() -> None:
    grid, arrays = Grid(), _model()
    messages = list(FedAvg().configure_train(1, arrays, ConfigRecord(), grid))
    for message in messages:
        message.metadata.__dict__["_message_id"] = message.object_id
    reply = grid.apps[11](messages[0], grid.contexts[11])
    assert "arrays" in reply.content and reply.content["metrics"]["num-examples"] == _examples(11)


DP = "gaussian:noise=1.0,clip=1.0,delta=1e-5"


def _clipped_sum(arrays: ArrayRecord, server_round: int, nodes: list[int], clip: float) -> np.ndarray:
    """The sum of the nodes' updates, each clipped to L2 norm ``clip``, flat (this test's flattening)."""
    state = arrays.to_torch_state_dict()
    total = 0.0
    for n in nodes:
        trained = _update(n, server_round, state)
        delta = np.concatenate([(trained[k] - state[k]).numpy().ravel() for k in state if state[k].is_floating_point()])
        total = total + delta.astype(np.float64) * min(1.0, clip / float(np.linalg.norm(delta)))
    return total


def test_under_distributed_dp_the_release_is_the_clipped_sum_over_qn_plus_the_devices_noise() -> None:
    """q = 1 (fraction_train 1): all four nodes sampled. What the coordinator releases minus the
    nodes' clipped updates summed over q N is the devices' Skellam noise: its standard deviation per
    coordinate is sqrt(4 mu_local) / scale / (q N). Over 38,282 coordinates the sample standard
    deviation's relative error is ~0.4% (1/sqrt(2d)); a 10% band is 25 standard errors wide, so a
    false alarm is out of reach, while noise missing, doubled or divided wrong is far outside it."""
    grid, arrays = Grid(), _model()
    wrapped = secure(FedAvg(fraction_train=1.0), SPEC, differential_privacy=DP)
    _, replies, (got, metrics) = _run_round(wrapped, grid, arrays, 1)
    assert metrics["fedge-secagg-survivors"] == 4 and metrics["dp_epsilon"] > 0
    assert all(set(r.content.keys()) == {UPDATE_RECORD, "metrics"} for r in replies)
    params = wrapped.dp.mechanism.noise(len(NODES))
    residual = _flat(got).astype(np.float64) - _flat(arrays) - _clipped_sum(arrays, 1, NODES, 1.0) / len(NODES)
    expected_std = np.sqrt(len(NODES) * params.local_variance) / params.scale / len(NODES)
    assert abs(residual.mean()) < 5 * expected_std / np.sqrt(residual.size)
    assert 0.9 < residual.std() / expected_std < 1.1
    assert len(wrapped.dp.mechanism.ledger.rounds) == 1
    # against the coordinator, which sampled them, each of the four spent one unamplified round
    assert sorted(wrapped.dp.mechanism.coordinator.devices) == sorted(str(n) for n in NODES)
    assert metrics["dp_epsilon_coordinator"] == wrapped.dp.mechanism.coordinator.worst()[0] > 0


def test_under_distributed_dp_the_coordinator_tops_up_the_noise_of_a_node_that_dropped() -> None:
    """Four nodes planned, each adding a quarter of the round's noise V; node 13 is lost after
    dealing its shares, so the unmasked sum carries 3V/4. The coordinator adds the missing quarter:
    what is released minus the three survivors' clipped updates over q N has the full standard
    deviation sqrt(V) / scale / (q N) (within 10%, 25 standard errors over 38,282 coordinates;
    without the top-up it would be sqrt(3/4) = 0.87 of it). The ledger records V, the same as for
    a round where nobody dropped; against the coordinator each survivor's round is worth the
    devices' 3V/4 only."""
    grid, arrays = Grid(), _model()
    grid.lost = {13}
    wrapped = secure(FedAvg(fraction_train=1.0), SPEC, differential_privacy=DP)
    _, _, (got, metrics) = _run_round(wrapped, grid, arrays, 1)
    survivors = [11, 12, 14]
    assert metrics["fedge-secagg-survivors"] == 3
    share = wrapped.dp.mechanism.noise(len(NODES))
    residual = _flat(got).astype(np.float64) - _flat(arrays) - _clipped_sum(arrays, 1, survivors, 1.0) / len(NODES)
    full = np.sqrt(len(NODES) * share.local_variance) / share.scale / len(NODES)
    assert 0.9 < residual.std() / full < 1.1, residual.std() / full
    (recorded,) = wrapped.dp.mechanism.ledger.rounds
    assert recorded[1] == pytest.approx(len(NODES) * share.local_variance)
    assert sorted(wrapped.dp.mechanism.coordinator.devices) == [str(n) for n in survivors]
    assert list(wrapped.dp.mechanism.coordinator.devices["11"]) == [(3 * share.local_variance, share.l1_bound, share.l2_bound)]


def test_under_distributed_dp_a_round_without_a_sum_still_releases_noise_and_is_charged() -> None:
    """Fewer than two nodes sampled: no secure round, and still the model moves by noise of the
    same scale drawn by the coordinator, on the sum's lattice (whether noise appears never depends on
    who answered). The round is charged like any other (whether it had a sum depends on the private
    sample: privacy audit 2, N4); against the coordinator no device spent anything."""
    grid, arrays = Grid(), _model()
    wrapped = secure(FedAvg(fraction_train=1.0), SPEC, differential_privacy=DP)
    wrapped.dp.mechanism.sample = lambda nodes: nodes[:1]  # one node sampled
    messages, _, (got, metrics) = _run_round(wrapped, grid, arrays, 1)
    assert messages == [] and metrics["fedge-secagg-survivors"] == 0
    moved = _flat(got).astype(np.float64) - _flat(arrays)
    params = wrapped.dp.mechanism.noise(len(NODES))  # the same scale as a released sum's, Sk(V) = 4 shares of V / 4
    expected_std = np.sqrt(len(NODES) * params.local_variance) / params.scale / len(NODES)
    assert 0.9 < moved.std() / expected_std < 1.1
    steps = moved * len(NODES) * params.scale  # the released noise in the ring's integer units
    assert np.allclose(steps, np.round(steps), atol=1e-2)  # on the lattice, not a float Gaussian
    assert len(wrapped.dp.mechanism.ledger.rounds) == 1 and metrics["dp_epsilon"] > 0
    assert wrapped.dp.mechanism.coordinator.devices == {} and metrics["dp_epsilon_coordinator"] == 0


def test_poisson_sampling_at_the_strategys_fraction() -> None:
    """Each node independently with probability q: over 4,000 draws of 4 nodes at q = 0.3 the count
    of sampled nodes has mean 4 q = 1.2 and variance 4 q (1 - q) = 0.84; each band is at least 6
    standard errors wide (a false alarm less than once in 10^8 runs)."""
    wrapped = secure(FedAvg(fraction_train=0.3), SPEC, differential_privacy=DP)
    wrapped.dp.mechanism.numel = 10  # as a round sizes it: its budget check needs the model's size
    counts = np.array([len(wrapped.dp.select(NODES, 0, 1)) for _ in range(4000)])
    assert abs(counts.mean() - 1.2) < 6 * np.sqrt(0.84 / 4000)
    assert abs(counts.var() - 0.84) < 6 * 0.84 * np.sqrt(2 / 4000) * 1.5


@pytest.mark.parametrize("kwargs, why", [
    ({"differential_privacy": "gaussian:noise=1,clip=1,adaptive=true"}, "adaptive clipping"),
    ({"differential_privacy": "gaussian:noise=1,clip=1", "secure_aggregation": "secagg:bits=12,clip=0.5,ratio=0.5"},
     "random-k"),
    ({"differential_privacy": "laplace:noise=1"}, "differential_privacy")])
def test_distributed_dp_refusals(kwargs, why) -> None:
    with pytest.raises(ValueError, match=why):
        secure(FedAvg(fraction_train=0.5), **{"secure_aggregation": SPEC, **kwargs})


def test_secure_over_compressed_keeps_the_lattice_downlink_and_masks_the_uplink() -> None:
    """``secure(compressed(FedAvg(), uplink="none", downlink="lattice:..."))``: the model goes out as
    lattice messages (the ClientApp's ``compression_mod`` rebuilds it before ``secure_mod`` masks the
    update), and the revealed mean moves the strategy's exact model as the plain mean would."""
    from fedge.flower import compression_mod
    from fedge.protocol.config_keys import CODEC_KEY
    from fedge.protocol.records import DOWNLINK_RECORD

    grid, arrays = Grid(), _model()
    for node in NODES:  # the user's app with both mods: the downlink's first
        grid.apps[node] = _user_app(grid.calls, (compression_mod, secure_mod))
    strategy = secure(compressed(FedAvg(), uplink="none", downlink="lattice:ratio=0.05"), SPEC)
    fp32 = sum(len(a.data) for a in arrays.values())
    for server_round in (1, 2):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord({"lr": 0.1}), grid))
        assert all(DOWNLINK_RECORD in m.content and "arrays" not in m.content for m in messages)
        assert all(CODEC_KEY not in m.content.config_records["config"] for m in messages)
        for m in messages:
            m.metadata.__dict__["_group_id"] = str(server_round)
        got, metrics = strategy.aggregate_train(server_round, grid.send_and_receive(messages))
        assert metrics["fedge-secagg-survivors"] == len(NODES) and metrics["fedge-downlink-bytes"] > 0
        if server_round > 1:  # a change, not the model: a fraction of the fp32 arrays to each node
            assert metrics["fedge-downlink-bytes"] < len(NODES) * fp32 / 4
        expected = _plain_mean(arrays, server_round, NODES)
        for name, array in got.items():
            if array.numpy().dtype.kind == "f":
                assert np.abs(array.numpy() - expected[name]).max() <= _bound(NODES, carried=server_round > 1)
        arrays = got


def test_distributed_dp_with_the_lattice_downlink_releases_the_clipped_sum_plus_the_devices_noise() -> None:
    """The lattice downlink under distributed DP: the Poisson sample's messages each carry their
    node's lattice message (the downlink layer runs after the sample), and the release is the
    clipped sum over q N plus the devices' noise, as without the downlink (the residual's standard
    deviation within 10% of the noise's, 25 standard errors), round after round."""
    from fedge.flower import compression_mod
    from fedge.protocol.records import DOWNLINK_RECORD

    grid, arrays = Grid(), _model()
    for node in NODES:  # the user's app with both mods: the downlink's first
        grid.apps[node] = _user_app(grid.calls, (compression_mod, secure_mod))
    wrapped = secure(compressed(FedAvg(fraction_train=1.0), uplink="none", downlink="lattice:ratio=0.05"), SPEC,
                     differential_privacy=DP)
    fp32 = sum(len(a.data) for a in arrays.values())
    for server_round in (1, 2):
        messages = list(wrapped.configure_train(server_round, arrays, ConfigRecord({"lr": 0.1}), grid))
        assert sorted(m.metadata.dst_node_id for m in messages) == NODES
        assert all(DOWNLINK_RECORD in m.content and "arrays" not in m.content for m in messages)
        for m in messages:
            m.metadata.__dict__["_group_id"] = str(server_round)
        got, metrics = wrapped.aggregate_train(server_round, grid.send_and_receive(messages))
        params = wrapped.dp.mechanism.noise(len(NODES))
        expected_std = np.sqrt(len(NODES) * params.local_variance) / params.scale / len(NODES)
        assert metrics["fedge-secagg-survivors"] == 4 and metrics["dp_epsilon"] > 0
        if server_round > 1:
            assert 0 < metrics["fedge-downlink-bytes"] < len(NODES) * fp32 / 4
        residual = _flat(got).astype(np.float64) - _flat(arrays) - _clipped_sum(arrays, server_round, NODES,
                                                                                 1.0) / len(NODES)
        assert 0.9 < residual.std() / expected_std < 1.1
        arrays = got


@pytest.mark.parametrize("make, why", [
    (lambda: compressed(secure(FedAvg(), SPEC)), "would decode masked uploads"),
    (lambda: secure(compressed(FedAvg(), uplink="qsgd:bits=4", downlink="lattice:ratio=0.05"), SPEC),
     "quantizes each update itself"),
])
def test_orders_that_cannot_work_are_refused_when_wrapped(make, why) -> None:
    with pytest.raises(ValueError, match=why):
        make()


@pytest.mark.parametrize("value", [True, "true", "1", "yes"])
def test_a_flower_apps_node_refuses_before_the_users_code_runs(value) -> None:
    """``secure_mod`` in a user's ClientApp: a plain (unwrapped) strategy's train message to a node
    that requires secure aggregation is refused (Flower's runtime replies with its error); the
    user's body never runs."""
    grid = Grid()
    for node in grid.contexts:
        grid.contexts[node] = Context(run_id=1, node_id=node, node_config={"require-secure-aggregation": value},
                                      state=RecordDict(), run_config={})
    messages = list(FedAvg().configure_train(1, _model(), ConfigRecord(), grid))
    for message in messages:
        message.metadata.__dict__["_message_id"] = message.object_id
    node = messages[0].metadata.dst_node_id
    with pytest.raises(PolicyRefusal, match="requires secure aggregation"):  # Flower replies with an error
        grid.apps[node](messages[0], grid.contexts[node])
    assert grid.calls == []


def test_distributed_dp_is_a_wrapper_of_its_own_around_secure_aggregation_only() -> None:
    """The "One coordinator" issue: DP was a constructor argument of SecureStrategy, not a wrapper.
    ``distributed_dp(secure(s), spec)`` is the same strategy as ``secure(s, differential_privacy=spec)``;
    around anything but ``secure(...)`` (the noise goes inside its ring), or twice, it is refused
    when wrapped, with the reason."""
    from fedge.flower import distributed_dp

    spec = "gaussian:noise=1.0,clip=0.5,delta=1e-5"
    wrapped = distributed_dp(secure(FedAvg(fraction_train=0.5)), spec)
    direct = secure(FedAvg(fraction_train=0.5), differential_privacy=spec)
    assert wrapped.dp is not None and direct.dp is not None
    assert (wrapped.dp.spec, wrapped.dp.mechanism.rate, wrapped.spec) == (direct.dp.spec, direct.dp.mechanism.rate, direct.spec)
    with pytest.raises(ValueError, match=r"wrap secure\(\.\.\.\) first"):
        distributed_dp(FedAvg(fraction_train=0.5), spec)
    with pytest.raises(ValueError, match="already carries distributed DP"):
        distributed_dp(wrapped, spec)


def test_secure_over_layered_is_one_round_with_every_layer_and_a_layer_that_changes_each_update_is_refused() -> None:
    """``secure(layered(strategy, *layers))`` runs the user's layers in the secure round, ordered with
    the secure-aggregation layer by what each declares: one that counts the replies sees each masked
    upload, one that releases a zero mean in place of the unmasked sum keeps the model exactly; a
    layer that changes each update is refused when wrapped (the coordinator never sees one)."""
    from fedge.flower import layered
    from tests.flower.test_layered import _Frozen, _Halving
    from tests.server.test_layers import CountingLayer

    grid, arrays = Grid(), _model()
    wrapped = secure(layered(FedAvg(), CountingLayer(), _Frozen()), SPEC)
    _, _, (got, metrics) = _run_round(wrapped, grid, arrays, 1)
    assert metrics["fedge-secagg-survivors"] == len(NODES) and metrics["test_counter.step"] == len(NODES)
    np.testing.assert_array_equal(_flat(got), _flat(arrays))
    with pytest.raises(ValueError, match="test-halving changes each update"):
        secure(layered(FedAvg(), _Halving()), SPEC)
    with pytest.raises(ValueError, match=r"secure\(\.\.\.\) already"):
        secure(secure(FedAvg(), SPEC), SPEC)


def test_with_an_issuer_a_flower_app_checks_identities_and_runs_the_consistency_round(tmp_path) -> None:
    """``secagg:...,issuer=ca.crt`` in a user's ServerApp, as in Fedge's engine (one session and
    round, ``fedge.coordinator.secure_session``): every node presents a credential from the operator's
    CA (its node config names its key, endorsement and the CA, as ``fedge-edge join`` writes them)
    and the survivors sign the survivor set before they reveal; the sum is the plain mean up to the
    grid's rounding. A node whose key another CA endorsed is refused with the reason; with four
    nodes the other three cannot reach the threshold an issuer requires (above two thirds of their
    neighbours), so that round releases nothing."""
    from fedge.protocol.secagg import secure_stage
    from tests.server.test_secure_aggregation import _issued_federation

    ca, config = _issued_federation(tmp_path, len(NODES) + 1, rogue=(len(NODES),))
    grid, arrays = Grid(), _model()
    for i, node in enumerate(NODES):
        grid.contexts[node] = Context(run_id=1, node_id=node, node_config=config[i], state=RecordDict(), run_config={})
    stages: list[str | None] = []
    send = grid.send_and_receive

    def recording(messages, *, timeout=None):  # type: ignore[no-untyped-def]
        stages.extend(secure_stage(m) for m in messages)
        return send(messages, timeout=timeout)

    grid.send_and_receive = recording  # type: ignore[method-assign]
    wrapped = secure(FedAvg(), f"{SPEC},issuer={ca}")
    _, _, (got, metrics) = _run_round(wrapped, grid, arrays, 1)
    assert metrics["fedge-secagg-survivors"] == len(NODES) and not wrapped.refused
    assert stages.count("consistency") == len(NODES)
    expected = _plain_mean(arrays, 1, NODES)
    for name, array in arrays.items():
        if array.numpy().dtype.kind == "f":
            assert np.abs(got[name].numpy() - expected[name]).max() <= _bound(NODES)
    rogue = NODES[1]  # now holds a key endorsed by another CA
    grid.contexts[rogue] = Context(run_id=1, node_id=rogue, node_config=config[len(NODES)], state=RecordDict(),
                                   run_config={})
    _, _, (again, metrics) = _run_round(wrapped, grid, got, 2)
    assert [node for _, node, _ in wrapped.refused][:1] == [rogue]
    assert "not endorsed by the operator's CA" in wrapped.refused[0][2]
    assert again is None and (metrics or {}).get("fedge-secagg-survivors", 0) == 0
