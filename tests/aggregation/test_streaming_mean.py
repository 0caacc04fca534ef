import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedge.aggregation import StreamingMean
from fedge.compression import make_codec


@given(
    weights=st.lists(st.integers(1, 500), min_size=1, max_size=12),
    n=st.integers(1, 300),
    seed=st.integers(0, 1000),
)
def test_equals_weighted_mean_of_decoded_updates(weights: list[int], n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codec = make_codec("qsgd:bits=4,bucket=64,norm=max")
    acc = StreamingMean(n)
    decoded = []
    for w in weights:
        payload = codec.encode(torch.randn(n, generator=gen), gen)
        decoded.append(codec.decode(payload, n))
        acc.add(codec.decode(payload, n), w)
    expected = sum(w * d.double() for w, d in zip(weights, decoded)) / sum(weights)
    assert torch.allclose(acc.mean(), expected.float(), atol=1e-5)
    assert acc.count == len(weights)


def test_order_does_not_matter() -> None:
    codec = make_codec("none")
    updates = [(torch.randn(1000), w) for w in (3, 1, 7, 2)]
    a, b = StreamingMean(1000), StreamingMean(1000)
    for u, w in updates:
        a.add(codec.decode(codec.encode(u), 1000), w)
    for u, w in reversed(updates):
        b.add(codec.decode(codec.encode(u), 1000), w)
    assert torch.allclose(a.mean(), b.mean(), rtol=1e-5, atol=1e-6)


def test_a_bad_weight_or_size_leaves_accumulator_untouched() -> None:
    acc = StreamingMean(100)
    acc.add(torch.ones(100), 5)
    before = acc.mean().clone()
    for weight in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            acc.add(torch.full((100,), 9.0), weight)
    with pytest.raises(ValueError):
        acc.add(torch.ones(99), 5)
    assert acc.count == 1 and torch.equal(acc.mean(), before)


def test_empty_mean_is_an_error() -> None:
    with pytest.raises(ValueError):
        StreamingMean(3).mean()


@given(weight=st.floats(1e-3, 1e6, allow_nan=False), n=st.integers(1, 200), seed=st.integers(0, 1000))
def test_the_mean_of_one_reply_is_that_reply_bit_for_bit(weight: float, n: int, seed: int) -> None:
    """(w * x) / w rounds off by an ulp in float32; the mean of one update must be the update."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    acc = StreamingMean(n)
    acc.add(x, weight)
    assert torch.equal(acc.mean(), x) and torch.equal(acc.partial().mean(), x)
    x.add_(1.0)  # the caller's vector changing later changes nothing held
    assert not torch.equal(acc.mean(), x)
    acc.add(x, weight)  # a second reply: the exact sum, whose mean is rounded once
    assert acc.count == 2 and torch.equal(acc.mean(), acc.partial().mean())
