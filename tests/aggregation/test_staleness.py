"""Staleness weights and the drop rule against their definitions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedge.aggregation.staleness import Staleness


def test_definitions() -> None:
    assert [Staleness("constant").weight(t) for t in (0, 3, 100)] == [1.0, 1.0, 1.0]
    poly = Staleness("poly", a=0.5)
    assert [poly.weight(t) for t in (0, 3, 8)] == pytest.approx([1.0, 0.5, 1 / 3])  # FedBuff: 1/sqrt(1+t)
    hinge = Staleness("hinge", a=10.0, b=4.0)
    assert [hinge.weight(t) for t in (0, 4, 5, 6)] == pytest.approx([1.0, 1.0, 1 / 11, 1 / 21])


@given(tau=st.integers(0, 10_000), a=st.floats(0, 5), b=st.floats(0, 50),
       function=st.sampled_from(["constant", "poly", "hinge"]))
def test_weights_are_in_0_1_and_never_grow_with_staleness(tau: int, a: float, b: float, function: str) -> None:
    rule = Staleness(function, a=a, b=b)
    w, later = rule.weight(tau), rule.weight(tau + 1)
    assert 0.0 < w <= 1.0 and math.isfinite(w)
    assert later <= w


def test_drop_rule_is_strictly_above_the_bound() -> None:
    rule = Staleness(max_staleness=3)
    assert [rule.dropped(t) for t in (0, 3, 4)] == [False, False, True]
    assert not Staleness(max_staleness=0).dropped(0) and Staleness(max_staleness=0).dropped(1)


@pytest.mark.parametrize("kwargs", [{"function": "linear"}, {"a": -1.0}, {"b": float("nan")},
                                    {"max_staleness": -1}])
def test_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Staleness(**kwargs)
    with pytest.raises(ValueError, match="negative"):
        Staleness().weight(-1)


@given(st.integers(0, 6), st.floats(0.01, 1.0), st.integers(0, 2**31 - 1))
def test_the_buffer_adds_s_tau_times_the_update_and_fedasync_rebuilds_the_clients_model(
        tau: int, alpha: float, seed: int) -> None:
    """What a reply does to a version, shared by the engine and ``fedge.flower``: FedBuff's buffer
    holds s(τ)·Δ with the reply's weight; FedAsync moves x towards the client's model x_v + Δ, which
    for τ = 0 is x + α_t·Δ and for α_t = 1 is the client's model itself."""
    from fedge.aggregation.staleness import fedasync_mix
    from fedge.aggregation.streaming_mean import StreamingMean

    gen = torch.Generator().manual_seed(seed)
    x, x_v, delta = (torch.randn(50, generator=gen) for _ in range(3))
    rule = Staleness("poly", a=0.5)
    buffer = StreamingMean(50)
    rule.add(buffer, delta, 3.0, tau)
    torch.testing.assert_close(buffer.mean(), delta * rule.weight(tau))
    alpha_t = alpha * rule.weight(tau)
    torch.testing.assert_close(fedasync_mix(x, x, delta, alpha_t), x + alpha_t * delta)
    torch.testing.assert_close(fedasync_mix(x, x_v, delta, 1.0), x_v + delta)
