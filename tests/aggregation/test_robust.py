"""Robust aggregation rules: hand-computed cases, Flower's own strategies on the same updates, and
the invariants the rules are chosen for (translation equivariance, outlier resistance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg, Krum, MultiKrum
from flwr.supercore.task_identity import TaskIdentity
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.aggregation.robust import (
    Median,
    TrimmedMean,
    aggregator_memory_bytes,
    make_aggregator,
    nearest_neighbour_mixing,
    validate_aggregator,
)
from fedge.aggregation.robust import (
    MultiKrum as OurMultiKrum,
)
from fedge.compression import SpecError


def _aggregate(spec: str, updates: list[torch.Tensor], weights: list[float] | None = None) -> torch.Tensor:
    agg = make_aggregator(spec, updates[0].numel(), capacity=len(updates))
    for i, u in enumerate(updates):
        agg.add(u, 1.0 if weights is None else weights[i])
    return agg.result()


def test_median_by_hand_odd_and_even() -> None:
    rows = [torch.tensor([1.0, -5.0]), torch.tensor([2.0, 0.0]), torch.tensor([100.0, 1.0])]
    assert _aggregate("median", rows).tolist() == [2.0, 0.0]
    rows.append(torch.tensor([3.0, 7.0]))
    assert _aggregate("median", rows).tolist() == [2.5, 0.5]  # mean of the middle two, like numpy


def test_trimmed_mean_by_hand() -> None:
    values = [-1000.0, 1.0, 2.0, 3.0, 4.0, 1000.0, 5.0, 6.0, 7.0, 8.0]
    rows = [torch.tensor([v]) for v in values]
    # beta=0.2 of 10 drops the 2 smallest and 2 largest: mean of 2..7
    assert _aggregate("trimmed-mean:beta=0.2", rows).item() == pytest.approx(4.5)
    assert _aggregate("trimmed-mean:beta=0", rows).item() == pytest.approx(sum(values) / 10)


def test_krum_picks_the_update_in_the_crowd_and_multikrum_weights_the_chosen() -> None:
    honest = [torch.tensor([1.0, 1.0]), torch.tensor([1.1, 0.9]), torch.tensor([0.9, 1.0]),
              torch.tensor([1.0, 1.2]), torch.tensor([1.05, 1.0])]
    byzantine = [torch.tensor([-10.0, -10.0]), torch.tensor([50.0, 0.0])]
    rows = honest + byzantine
    krum = make_aggregator("krum:f=2", 2, capacity=len(rows))
    for r in rows:
        krum.add(r, 1.0)
    result = krum.result()
    chosen = krum.chosen()
    assert chosen is not None and len(chosen) == 1 and chosen[0] < len(honest)
    assert torch.equal(result, rows[chosen[0]])
    multi = make_aggregator("multikrum:f=2,m=3", 2, capacity=len(rows))
    weights = [1.0, 2.0, 3.0, 4.0, 5.0, 100.0, 100.0]
    for r, w in zip(rows, weights):
        multi.add(r, w)
    assert multi.chosen() is None  # nothing chosen before the step closes
    result = multi.result()
    picked = multi.chosen()
    assert picked is not None and len(picked) == 3 and all(i < len(honest) for i in picked)
    expected = sum(weights[i] * rows[i] for i in picked) / sum(weights[i] for i in picked)
    torch.testing.assert_close(result, expected)


# -- Flower's own strategies on the same updates -----------------------------------------------
def _flower_replies(updates: list[np.ndarray], weights: list[int]) -> list[Message]:
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    replies = []
    for i, (u, w) in enumerate(zip(updates, weights)):
        instruction = Message(RecordDict(), dst_node_id=i + 1, message_type=MessageType.TRAIN)
        # Two layers, as a model has: Flower aggregates per layer, we on the flat vector.
        content = RecordDict({"arrays": ArrayRecord([u[:5].copy(), u[5:].copy()]),
                              "metrics": MetricRecord({"num-examples": w})})
        replies.append(Message(content, reply_to=instruction))
    return replies


@pytest.mark.parametrize(("ours", "flower"), [
    ("median", lambda: FedMedian()),
    ("trimmed-mean:beta=0.2", lambda: FedTrimmedAvg(beta=0.2)),
    ("trimmed-mean:beta=0.1", lambda: FedTrimmedAvg(beta=0.1)),
    ("krum:f=2", lambda: Krum(num_malicious_nodes=2)),
    ("multikrum:f=2,m=4", lambda: MultiKrum(num_malicious_nodes=2, num_nodes_to_select=4)),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_flowers_strategy_on_the_same_updates(ours: str, flower, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 11
    updates = [rng.standard_normal(37).astype(np.float32) * rng.uniform(0.5, 3.0) for _ in range(n)]
    updates[3] = updates[3] * -10.0  # a sign-flipped, scaled update among them
    weights = [int(w) for w in rng.integers(5, 200, size=n)]
    arrays, _ = flower().aggregate_train(1, _flower_replies(updates, weights))
    expected = np.concatenate([a.ravel() for a in arrays.to_numpy_ndarrays()])
    got = _aggregate(ours, [torch.from_numpy(u) for u in updates], [float(w) for w in weights])
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(3, 9),
    dim=st.integers(1, 12),
    shift=st.floats(-100, 100, allow_nan=False),
    seed=st.integers(0, 2**31 - 1),
    spec=st.sampled_from(["median", "trimmed-mean:beta=0.2", "krum:f=0", "multikrum:f=0,m=2"]),
)
def test_rules_are_translation_equivariant(n: int, dim: int, shift: float, seed: int, spec: str) -> None:
    """rule(x_i + c) = rule(x_i) + c: why applying a rule to updates equals applying it to models."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(dim, generator=gen, dtype=torch.float64).float() for _ in range(n)]
    plain = _aggregate(spec, rows)
    shifted = _aggregate(spec, [r + shift for r in rows])
    torch.testing.assert_close(shifted, plain + shift, rtol=1e-4, atol=1e-3)


def test_median_and_trimmed_mean_bound_a_minority_of_huge_updates() -> None:
    gen = torch.Generator().manual_seed(0)
    honest = [torch.randn(50, generator=gen) * 0.1 + 1.0 for _ in range(8)]
    hostile = [-1e6 * torch.ones(50), -1e6 * torch.ones(50)]  # 20%: sign-flipped and enormous
    for spec in ("median", "trimmed-mean:beta=0.2"):
        result = _aggregate(spec, honest + hostile)
        assert float(result.min()) > 0.5 and float(result.max()) < 1.5, spec
    mean = _aggregate("mean", honest + hostile)
    assert float(mean.max()) < -1e4  # the plain mean follows the attackers


def test_mean_streams_and_robust_rules_state_their_memory() -> None:
    assert make_aggregator("mean", 10, 5).streaming
    assert not make_aggregator("median", 10, 5).streaming
    assert aggregator_memory_bytes("mean", 1000, 100) == 12_000  # the exact sum's two limbs
    assert aggregator_memory_bytes("median", 1000, 100) == 404_000  # the updates and one spare row
    # the updates, the spare row and the chosen ones' exact mean
    assert aggregator_memory_bytes("krum:f=1", 1000, 100) == 4 * 1000 * 104 + 8 * 100 * 100


def test_configuration_over_the_memory_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="over the limit"):
        validate_aggregator("median", numel=1_000_000, capacity=1000, limit_bytes=1024 * 2**20)
    validate_aggregator("mean", numel=1_000_000, capacity=1000, limit_bytes=1024 * 2**20)  # streams: fine


@pytest.mark.parametrize(("spec", "capacity", "match"), [
    ("krum:f=2", 6, "n >= 2f \\+ 3"),
    ("multikrum:f=1,m=9", 8, "keeps more updates"),
    ("trimmed-mean:beta=0.5", 8, "beta must be in"),
    ("krum:f=-1", 8, ">= 0"),
])
def test_impossible_parameters_are_refused(spec: str, capacity: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_aggregator(spec, 4, capacity)


def test_unknown_rule_and_parameter_are_spec_errors() -> None:
    with pytest.raises(SpecError, match="unknown aggregator"):
        make_aggregator("mode", 4, 4)
    with pytest.raises(SpecError, match="no parameter"):
        make_aggregator("median:beta=0.1", 4, 4)


def test_buffered_rules_refuse_more_updates_than_their_capacity_and_bad_input() -> None:
    agg = Median(3, capacity=2)
    agg.add(torch.zeros(3), 1.0)
    agg.add(torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="at most 2"):
        agg.add(torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="elements"):
        TrimmedMean(3, capacity=2).add(torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match="no update"):
        OurMultiKrum(3, capacity=5, f=1).result()


# -- nearest-neighbour mixing (nnm=F) -----------------------------------------------------------

def test_nnm_by_hand() -> None:
    """Four points on a line, F = 2: each becomes the mean of itself and its nearest other."""
    rows = torch.tensor([[0.0], [1.0], [3.0], [10.0]])
    mixed = nearest_neighbour_mixing(rows, f=2)
    # 0 -> {0, 1}; 1 -> {1, 0}; 3 -> {3, 1}; 10 -> {10, 3}
    assert mixed.squeeze(1).tolist() == pytest.approx([0.5, 0.5, 2.0, 6.5])
    # F = 0: everyone's neighbourhood is everyone; F >= n - 1: only itself
    assert nearest_neighbour_mixing(rows, f=0).squeeze(1).tolist() == pytest.approx([3.5] * 4)
    assert torch.equal(nearest_neighbour_mixing(rows, f=3), rows)


def test_nnm_keeps_a_row_in_its_own_neighbourhood_when_others_are_identical() -> None:
    rows = torch.tensor([[1.0], [1.0], [1.0], [-50.0]])
    assert nearest_neighbour_mixing(rows, f=3).squeeze(1).tolist() == [1.0, 1.0, 1.0, -50.0]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 9), dim=st.integers(1, 8), f=st.integers(0, 8), seed=st.integers(0, 2**31 - 1))
def test_nnm_is_permutation_equivariant_and_stays_in_the_hull(n: int, dim: int, f: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, dim, generator=gen)
    mixed = nearest_neighbour_mixing(rows, f)
    perm = torch.randperm(n, generator=gen)
    torch.testing.assert_close(nearest_neighbour_mixing(rows[perm], f), mixed[perm])
    # a mean of rows: inside their coordinate-wise range
    assert bool((mixed >= rows.min(dim=0).values - 1e-5).all() and (mixed <= rows.max(dim=0).values + 1e-5).all())


def test_nnm_pulls_spread_honest_updates_together_and_krum_then_applies_their_mean() -> None:
    """Why NNM exists: skewed (far apart) honest updates. Krum alone applies one of them; after
    mixing, the honest ones all become the honest mean and Krum applies that."""
    gen = torch.Generator().manual_seed(3)
    honest = [torch.ones(20) + 0.8 * torch.randn(20, generator=gen) for _ in range(16)]
    hostile = [-10.0 * h for h in honest[:4]]  # sign-flipped, x10
    honest_mean = torch.stack(honest).mean(dim=0)
    plain = _aggregate("krum:f=4", honest + hostile)
    mixed = _aggregate("krum:f=4,nnm=4", honest + hostile)
    assert torch.dist(mixed, honest_mean) < 1e-5
    assert torch.dist(plain, honest_mean) > 1.0
    trimmed = _aggregate("trimmed-mean:beta=0.2,nnm=4", honest + hostile)
    assert torch.dist(trimmed, honest_mean) < 1e-5
    assert torch.dist(_aggregate("trimmed-mean:beta=0.2", honest + hostile), honest_mean) > 10 * torch.dist(
        trimmed, honest_mean)


def test_nnm_spec_memory_and_refusals() -> None:
    agg = make_aggregator("multikrum:f=1,m=2,nnm=1", 4, capacity=6)
    assert agg.spec == "multikrum:f=1,m=2,nnm=1"
    assert make_aggregator("median:nnm=2", 4, capacity=6).spec == "median:nnm=2"
    # NNM holds a mixed copy of the buffer, the distance matrix and one float64 accumulator row on top
    # of the rule's own memory
    assert aggregator_memory_bytes("trimmed-mean:beta=0.2,nnm=4", 1000, 20) == (
        4 * 1000 * 21 + 4 * 1000 * 20 + 8 * 20 * 20 + 8 * 1000)  # 21: the updates and the spare row
    assert aggregator_memory_bytes("krum:f=1,nnm=1", 1000, 100) == (
        4 * 1000 * 104 + 8 * 100 * 100 + 4 * 1000 * 100 + 8 * 100 * 100 + 8 * 1000)
    with pytest.raises(ValueError, match="nnm"):
        make_aggregator("median:nnm=6", 4, capacity=6)
    with pytest.raises(ValueError, match="nnm"):
        make_aggregator("median:nnm=-1", 4, capacity=6)
    with pytest.raises(SpecError, match="no parameter"):
        make_aggregator("mean:nnm=1", 4, capacity=6)  # the streaming mean cannot mix
