"""The step's partial aggregate: the producer's numbers exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.aggregation.partial import Partial, PartialError
from fedge.aggregation.robust import make_aggregator
from fedge.aggregation.streaming_mean import StreamingMean

updates = st.lists(st.tuples(st.lists(st.floats(-100, 100, width=32), min_size=5, max_size=5),
                             st.integers(1, 50)), min_size=1, max_size=8)


def _stream(rows: list[tuple[list[float], int]]) -> StreamingMean:
    mean = StreamingMean(5)
    for values, weight in rows:
        mean.add(torch.tensor(values, dtype=torch.float32), weight)
    return mean


@settings(max_examples=60, deadline=None)
@given(updates)
def test_a_streaming_means_partial_gives_its_numbers_bit_for_bit(rows) -> None:
    stream = _stream(rows)
    partial = stream.partial()
    assert torch.equal(partial.mean(), stream.mean()) and torch.equal(partial.sum(), stream.sum())
    assert (partial.count, partial.weight) == (stream.count, stream.total_weight)


def test_a_mean_held_partial_reads_the_producers_mean_and_sums_by_its_weight() -> None:
    mean = torch.tensor([0.1, 0.2, 0.3])
    partial = Partial.of_mean(mean, 4.0, 2)
    assert partial.mean() is mean
    torch.testing.assert_close(partial.sum(), mean * 4.0)


def test_empty_noised_and_robust_partials() -> None:
    empty = Partial.empty(3, planned=4)
    assert empty.is_empty and not empty.ready(1) and empty.planned == 4
    with pytest.raises(PartialError, match="no update"):
        empty.mean()
    assert Partial.of_mean(torch.zeros(3), 1.0, 0, noised=True).ready(5)  # noise is released whoever answered
    median = make_aggregator("median", 3, 3)
    for v in ([1.0, 2.0, 3.0], [2.0, 2.0, 2.0], [9.0, 0.0, 1.0]):
        median.add(torch.tensor(v), 1.0)
    robust = median.partial()
    torch.testing.assert_close(robust.mean(), torch.tensor([2.0, 2.0, 2.0]))
    assert (robust.weight, robust.count) == (1.0, 3)  # the rule's output, of unit weight


def test_bad_partials_are_refused() -> None:
    with pytest.raises(PartialError, match="flat vector of 3"):
        Partial(3, total=torch.zeros(4))
    with pytest.raises(PartialError, match="sum or its mean"):
        Partial(3, total=torch.zeros(3), average=torch.zeros(3))
