"""EASGD in a Flower app: ``layered(FedAvg(), ElasticAveraging(alpha, beta))`` with ``elastic_mod``
on the ClientApp, message by message in-process. Each node trains its own model from where it
stood, sends the elastic difference and keeps the rest; the strategy's model is the center and
moves by EASGD's step, the formulas Fedge's own EASGD uses (``fedge.aggregation.elastic``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg, FedMedian

from fedge.flower import ElasticAveraging, compressed, compression_mod, elastic_mod, layered
from tests.flower.test_compressed_strategy import NODES, Grid, _contexts, _exchange, _flat, _model

ALPHA, BETA = 0.3, 0.9


def _shift(node: int, like: np.ndarray) -> np.ndarray:
    """What node ``node``'s local training adds to whatever model it trains (a fixed vector)."""
    return (0.01 * (node - 10) * np.random.default_rng(node).standard_normal(like.size)).astype(np.float32)


def _app(mods: list, seen: dict[int, list[np.ndarray]]) -> ClientApp:  # type: ignore[type-arg]
    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:  # a user's body: weights in, weights out
        received = msg.content["arrays"]
        flat = _flat(received)
        seen.setdefault(context.node_id, []).append(flat)
        trained, offset = {}, 0
        shift = _shift(context.node_id, flat)
        for name, array in received.to_torch_state_dict().items():
            if array.is_floating_point():
                trained[name] = array + torch.from_numpy(shift[offset:offset + array.numel()]).reshape(array.shape)
                offset += array.numel()
            else:
                trained[name] = array
        return Message(RecordDict({"arrays": ArrayRecord(trained),
                                   "metrics": MetricRecord({"num-examples": 10 * (context.node_id - 10)})}),
                       reply_to=msg)

    return app


def _rounds(strategy, mods: list, arrays: ArrayRecord, rounds: int = 2):  # type: ignore[no-untyped-def]
    seen: dict[int, list[np.ndarray]] = {}
    apps, contexts, out = {n: _app(mods, seen) for n in NODES}, _contexts(), []
    for server_round in range(1, rounds + 1):
        replies = _exchange(list(strategy.configure_train(server_round, arrays, ConfigRecord({}), Grid())), apps,
                            contexts)
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        out.append((_flat(arrays), metrics))
    return out, seen


def test_each_node_trains_its_own_model_and_the_center_moves_by_easgds_step() -> None:
    """Round 1: every node starts from the center x0 and keeps x0 + (1 - a) c; the center moves to
    x0 + (b / (a m)) sum a c. Round 2: each node trains the model it kept, not the new center (the
    elastic tie, not a restart), and the center moves by the same rule from the differences to it.
    Every node weighs the same, whatever its example count."""
    model = _model()
    start = _flat(model)
    (one, metrics), (two, _) = _rounds(layered(FedAvg(), ElasticAveraging(ALPHA, BETA)), [elastic_mod], model)[0]
    shifts = {n: _shift(n, start) for n in NODES}
    center = start + BETA / (ALPHA * len(NODES)) * sum(ALPHA * shifts[n] for n in NODES)
    np.testing.assert_allclose(one, center, rtol=0, atol=1e-6)
    kept = {n: start + (1 - ALPHA) * shifts[n] for n in NODES}
    distances = [float(np.linalg.norm(shifts[n])) for n in NODES]
    assert metrics["center_distance"] == pytest.approx(sum(distances) / len(NODES), rel=1e-5)
    deltas = [ALPHA * (kept[n] + shifts[n] - center) for n in NODES]
    np.testing.assert_allclose(two, center + BETA / (ALPHA * len(NODES)) * sum(deltas), rtol=0, atol=1e-6)


def test_the_body_sees_the_nodes_own_model_and_compression_mod_encodes_the_difference() -> None:
    """With ``compression_mod`` outside it (fp32 codec: exact), the rounds are the same; the user's
    body got the center once, then the model the node kept."""
    model = _model()
    start = _flat(model)
    plain, _ = _rounds(layered(FedAvg(), ElasticAveraging(ALPHA, BETA)), [elastic_mod], model)
    wrapped, seen = _rounds(layered(compressed(FedAvg(), uplink="none"), ElasticAveraging(ALPHA, BETA)),
                            [compression_mod, elastic_mod], model)
    for (got, _), (expected, _) in zip(wrapped, plain):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    for node in NODES:
        first, second = seen[node]
        np.testing.assert_array_equal(first, start)
        np.testing.assert_allclose(second, start + (1 - ALPHA) * _shift(node, start), rtol=0, atol=1e-6)


def test_a_strategy_that_ranks_its_updates_or_a_bad_coupling_is_refused() -> None:
    with pytest.raises(ValueError, match="FedMedian aggregates each update itself"):
        layered(FedMedian(), ElasticAveraging())
    with pytest.raises(ValueError, match="alpha and beta must be in"):
        ElasticAveraging(alpha=0.0)
