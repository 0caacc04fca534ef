"""Exact sums: one result for one set of terms, whatever their order, and the right one."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.aggregation import StreamingMean
from fedge.aggregation.exact_sum import TERM_LIMIT, AccumulationRangeError, ExactScalar, ExactSum
from fedge.aggregation.robust import make_aggregator
from fedge.compression import PayloadError

terms = st.lists(
    st.tuples(st.lists(st.floats(-1e4, 1e4, width=32), min_size=6, max_size=6),
              st.one_of(st.integers(1, 5000).map(float), st.floats(1e-3, 1e3))),
    min_size=2, max_size=9)


def _vectors(rows):  # type: ignore[no-untyped-def]
    return [(torch.tensor(v, dtype=torch.float32), w) for v, w in rows]


@settings(max_examples=80, deadline=None)
@given(terms, st.randoms(use_true_random=False))
def test_any_order_gives_the_same_bits(rows, shuffler) -> None:
    items = _vectors(rows)
    reordered = items[:]
    shuffler.shuffle(reordered)
    a, b = StreamingMean(6), StreamingMean(6)
    for x, w in items:
        a.add(x, w)
    for x, w in reordered:
        b.add(x, w)
    assert torch.equal(a.mean(), b.mean()) and torch.equal(a.sum(), b.sum())
    assert a.total_weight == b.total_weight


@settings(max_examples=80, deadline=None)
@given(terms)
def test_the_sum_is_the_exact_sum_rounded_once(rows) -> None:
    items = _vectors(rows)
    exact = ExactSum(6)
    for x, w in items:
        exact.add(x, w)
    for j in range(6):  # math.fsum: the correctly rounded sum of the same float64 terms
        expected = math.fsum(float(torch.tensor(float(x[j]), dtype=torch.float64) * w) for x, w in items)
        got = float(exact.value(torch.float64)[j])
        assert got == pytest.approx(expected, rel=1e-12, abs=len(items) * 2.0**-54)


def test_a_float32_running_sum_depends_on_the_order_and_the_exact_one_does_not() -> None:
    """Why the exact sum exists: the same replies in two orders part in float32's last bits."""
    gen = torch.Generator().manual_seed(0)
    items = [(torch.randn(10_000, generator=gen) * 10 ** float(k % 5 - 2), float(1 + 13 * k)) for k in range(12)]
    orders = [items, items[::-1], random.Random(3).sample(items, len(items))]
    naive = []
    for order in orders:
        total = torch.zeros(10_000)
        for x, w in order:
            total.add_(x, alpha=w)
        naive.append(total)
    assert not all(torch.equal(naive[0], other) for other in naive[1:])
    means = []
    for order in orders:
        mean = StreamingMean(10_000)
        for x, w in order:
            mean.add(x, w)
        means.append(mean.mean())
    assert all(torch.equal(means[0], other) for other in means[1:])


def test_a_term_out_of_range_is_refused_and_leaves_the_sum_as_it_was() -> None:
    total = ExactSum(3)
    total.add(torch.tensor([1.0, -2.0, 3.0]), 2.0)
    before = total.value().clone()
    for bad in ([float("nan"), 0, 0], [float("inf"), 0, 0], [TERM_LIMIT, 0, 0]):
        with pytest.raises(AccumulationRangeError):
            total.add(torch.tensor(bad), 1.0)
    assert issubclass(AccumulationRangeError, PayloadError)  # every door refuses the reply that carried it
    assert torch.equal(total.value(), before) and total.count == 1
    mean = StreamingMean(3)
    with pytest.raises(AccumulationRangeError):
        mean.add(torch.tensor([float("nan"), 0.0, 0.0]), 1.0)
    assert mean.count == 0
    mean.add(torch.tensor([1.0, 2.0, 3.0]), 1.0)
    with pytest.raises(AccumulationRangeError):  # the second reply is checked before the first is converted
        mean.add(torch.tensor([1e12, 0.0, 0.0]), 1.0)
    assert mean.count == 1 and torch.equal(mean.mean(), torch.tensor([1.0, 2.0, 3.0]))


def test_the_first_reply_becomes_the_exact_sum_in_its_own_memory() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    built = ExactSum.from_float32(x.clone(), 7.0)
    added = ExactSum(100_000)
    added.add(x, 7.0)
    assert torch.equal(built.hi, added.hi) and torch.equal(built.lo, added.lo)
    assert built.nbytes() == 12 * 100_000


def test_exact_scalar_is_order_free() -> None:
    values = [1e16, 1.0, -1e16, 3.5, 1e-8] * 3
    forward, backward = ExactScalar(), ExactScalar()
    for v in values:
        forward.add(v)
    for v in reversed(values):
        backward.add(v)
    assert forward.value == backward.value == math.fsum(values) and forward.count == 15


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.floats(-10, 10, width=32), min_size=4, max_size=4), min_size=5, max_size=8),
       st.sampled_from(["trimmed-mean:beta=0.2", "krum:f=1", "multikrum:f=1,m=2", "median:nnm=1", "sparse-mean"]),
       st.randoms(use_true_random=False))
def test_robust_and_sparse_rules_do_not_depend_on_the_order(rows, spec, shuffler) -> None:
    items = [(torch.tensor(r), 1.0 + i % 3) for i, r in enumerate(rows)]
    order = list(range(len(items)))
    shuffler.shuffle(order)
    a = make_aggregator(spec, 4, capacity=len(items))
    b = make_aggregator(spec, 4, capacity=len(items))
    for x, w in items:
        a.add(x, w)
    for i in order:
        b.add(*items[i])
    assert torch.equal(a.result(), b.result())
    if a.chosen() is not None:  # the same updates chosen (b's position j holds item order[j])
        def picked(positions):  # type: ignore[no-untyped-def]
            return sorted((tuple(items[i][0].tolist()), items[i][1]) for i in positions)

        assert picked(a.chosen()) == picked(order[j] for j in b.chosen())
