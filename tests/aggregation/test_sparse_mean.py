"""sparse-mean: each coordinate over the updates that sent it; the plain mean for dense updates."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.aggregation import SparseMean
from fedge.aggregation.robust import Mean, aggregator_memory_bytes, make_aggregator
from fedge.compression import make_codec


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.integers(1, 50), min_size=1, max_size=8), n=st.integers(1, 200),
       seed=st.integers(0, 10_000))
def test_each_coordinate_is_the_weighted_mean_of_its_senders(weights: list[int], n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codec = make_codec("topk:ratio=0.2")
    rule = make_aggregator("sparse-mean", n, len(weights))
    rows = []
    for w in weights:
        decoded = codec.decode(codec.encode(torch.randn(n, generator=gen), gen), n)
        rows.append(decoded)
        rule.add(decoded, w)
    stacked = torch.stack(rows).double()
    w = torch.tensor(weights, dtype=torch.float64)[:, None]
    senders = (stacked != 0).double() * w
    expected = torch.where(senders.sum(0) > 0, (stacked * w).sum(0) / senders.sum(0).clamp(min=1e-300), 0.0)
    assert torch.allclose(rule.result().double(), expected, atol=1e-5)
    assert rule.count == len(weights)


def test_dense_updates_give_the_plain_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    sparse, mean = SparseMean(64, 3), Mean(64, 3)
    for w in (1.0, 5.0, 2.5):
        v = torch.randn(64, generator=gen)
        sparse.add(v, w)
        mean.add(v, w)
    assert torch.allclose(sparse.result(), mean.result(), atol=1e-6)


def test_a_coordinate_one_device_sent_is_not_diluted_by_the_others() -> None:
    """The point of the rule: two devices, one sent coordinate 0, the other coordinate 1; the plain
    mean halves both, the sparse mean applies each as sent; an unsent coordinate stays 0."""
    rule = SparseMean(3, 2)
    rule.add(torch.tensor([2.0, 0.0, 0.0]), 1.0)
    rule.add(torch.tensor([0.0, -4.0, 0.0]), 3.0)
    assert rule.result().tolist() == [2.0, -4.0, 0.0]


def test_refuses_bad_input_and_an_empty_step() -> None:
    rule = SparseMean(4, 2)
    with pytest.raises(ValueError, match="no update"):
        rule.result()
    with pytest.raises(ValueError, match="weight"):
        rule.add(torch.ones(4), float("nan"))
    with pytest.raises(ValueError, match="expected 4"):
        rule.add(torch.ones(5), 1.0)
    assert rule.count == 0
    assert aggregator_memory_bytes("sparse-mean", 1000, 100) == 20_000  # streaming, any count: the exact sum (12 B) and int64 weights
