"""Staleness weights and the drop rule against their definitions."""

from __future__ import annotations

import math

import pytest
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
