"""Norm bound and weight cap against their definitions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.aggregation.robust import make_aggregator
from fedge.aggregation.update_bounds import UpdateRejected, make_norm_bound, make_weight_cap
from fedge.compression import SpecError


@settings(max_examples=50, deadline=None)
@given(limit=st.floats(0.01, 100), scale=st.floats(0.001, 1000), seed=st.integers(0, 2**31 - 1))
def test_clip_leaves_small_updates_alone_and_scales_large_ones_to_the_bound(limit: float, scale: float,
                                                                             seed: int) -> None:
    update = torch.randn(64, generator=torch.Generator().manual_seed(seed)) * scale
    bounded, note = make_norm_bound(f"clip:max={limit}").apply(update)
    norm = float(update.norm())
    if norm <= limit:
        assert note is None and torch.equal(bounded, update)
    else:
        assert note is not None and float(bounded.norm()) == pytest.approx(limit, rel=1e-5)
        torch.testing.assert_close(bounded / bounded.norm(), update / update.norm())  # same direction


def test_reject_refuses_an_update_over_the_bound() -> None:
    bound = make_norm_bound("reject:max=1")
    assert bound.apply(torch.tensor([0.6, 0.8]))[1] is None  # norm exactly 1 passes
    with pytest.raises(UpdateRejected, match="exceeds the bound"):
        bound.apply(torch.tensor([3.0, 4.0]))


def test_relative_bound_follows_the_previous_steps_median_norm() -> None:
    bound = make_norm_bound("clip:factor=2")
    assert bound.limit() is None  # no reference in the first step
    for norm in (1.0, 2.0, 3.0):
        bound.apply(torch.tensor([norm]))
    bound.close_step()
    assert bound.limit() == pytest.approx(4.0)  # 2 x median(1, 2, 3)
    bounded, note = bound.apply(torch.tensor([-40.0]))
    assert bounded.item() == pytest.approx(-4.0) and note
    both = make_norm_bound("reject:max=3,factor=2")
    both.apply(torch.tensor([2.0]))
    both.close_step()
    assert both.limit() == 3.0  # the tighter of max=3 and 2 x 2
    restored = make_norm_bound("clip:factor=2")
    restored.load_state_dict(bound.state_dict())
    assert restored.limit() == bound.limit()


def test_weight_cap_equal_weights_first_then_capped_at_factor_times_median() -> None:
    cap = make_weight_cap("median:factor=5")
    first = [cap.weight(c)[0] for c in (50.0, 100.0, 150.0, 1e9)]
    assert first == [1.0, 1.0, 1.0, 1.0]  # no reference yet: nobody outweighs anybody
    cap.close_step()  # reference: median(50, 100, 150, 1e9) = 125
    assert cap.weight(100.0) == (100.0, None)
    weight, note = cap.weight(1e9)
    assert weight == pytest.approx(625.0) and "capped" in note


def test_a_client_claiming_a_billion_examples_moves_the_mean_no_more_than_an_honest_one_at_the_cap() -> None:
    cap = make_weight_cap("median:factor=5")
    for claim in (90.0, 100.0, 110.0):
        cap.weight(claim)
    cap.close_step()
    honest_at_cap = 5 * 100.0
    liar = cap.weight(1e9)[0]
    assert liar == pytest.approx(honest_at_cap)
    assert cap.weight(honest_at_cap)[0] == pytest.approx(honest_at_cap)

    def mean_with(claimed: float) -> torch.Tensor:
        agg = make_aggregator("mean", 1, 4)
        for value, c in ((0.0, 90.0), (0.0, 100.0), (0.0, 110.0)):
            agg.add(torch.tensor([value]), cap.weight(c)[0])
        agg.add(torch.tensor([1.0]), cap.weight(claimed)[0])
        return agg.result()

    assert mean_with(1e9).item() == pytest.approx(mean_with(honest_at_cap).item())
    assert mean_with(1e9).item() < 0.65  # ~0.6, not ~1.0 as the raw claim would make it


def test_fixed_and_no_cap() -> None:
    assert make_weight_cap("fixed:max=200").weight(1e9)[0] == 200.0
    assert make_weight_cap("fixed:max=200").weight(20.0) == (20.0, None)
    assert make_weight_cap("none").weight(1e9) == (1e9, None)


@pytest.mark.parametrize("spec", ["clip", "reject:max=-1", "clip:max=inf", "weird:max=1"])
def test_bad_norm_specs(spec: str) -> None:
    with pytest.raises(ValueError):  # SpecError is a ValueError
        make_norm_bound(spec)


@pytest.mark.parametrize("spec", ["median:factor=0.5", "fixed", "fixed:max=0", "median:cap=3"])
def test_bad_weight_caps(spec: str) -> None:
    with pytest.raises(ValueError):
        make_weight_cap(spec)


def test_weights_must_be_positive_and_finite() -> None:
    for claim in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            make_weight_cap("median").weight(claim)
    assert issubclass(SpecError, ValueError)
