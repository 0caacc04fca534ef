"""``model-average``: the exponential moving average of published models (pure math)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.aggregation.model_average import ModelAverage, parse_model_average

models = st.lists(st.lists(st.floats(-1e3, 1e3, width=32), min_size=4, max_size=4), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(models, st.floats(0.0, 0.99))
def test_the_average_stays_within_the_published_models_and_matches_the_recurrence(sequence, decay) -> None:
    average = ModelAverage(decay)
    tensors = [torch.tensor(m, dtype=torch.float32) for m in sequence]
    for t in tensors:
        out = average.update(t)
    stacked = torch.stack(tensors)
    tol = 1e-3 * (1 + stacked.abs().max())
    assert torch.all(out >= stacked.min(0).values - tol) and torch.all(out <= stacked.max(0).values + tol)
    expected = tensors[0].double()
    for t in tensors[1:]:
        expected = decay * expected + (1 - decay) * t.double()
    assert torch.allclose(out.double(), expected, atol=float(tol))
    assert average.count == len(tensors)


def test_it_starts_at_the_first_model_and_a_constant_sequence_is_its_own_average() -> None:
    average = ModelAverage(0.8)
    assert average.value() is None
    x = torch.arange(5, dtype=torch.float32)
    assert torch.equal(average.update(x), x)  # the initial model never enters the average
    assert torch.equal(average.update(x), x)


def test_state_round_trips_and_a_resumed_average_continues_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    seq = [torch.randn(7, generator=g) for _ in range(6)]
    whole = ModelAverage(0.7)
    for t in seq:
        whole.update(t)
    first = ModelAverage(0.7)
    for t in seq[:3]:
        first.update(t)
    second = ModelAverage(0.7)
    second.load_state_dict(first.state_dict())
    for t in seq[3:]:
        second.update(t)
    assert torch.equal(second.value(), whole.value()) and second.count == 6
    with pytest.raises(ValueError, match="decay 0.7"):
        ModelAverage(0.9).load_state_dict(first.state_dict())


def test_bad_specs_and_inputs_are_refused_with_their_reason() -> None:
    assert parse_model_average("none") is None
    assert parse_model_average("ema").decay == 0.8
    assert parse_model_average("ema:decay=0.5").spec == "ema:decay=0.5"
    for spec, reason in (("swa", "'none' or 'ema"), ("ema:decay=1", r"\[0, 1\)"), ("ema:decay=x", "number"),
                         ("ema:beta=0.5", r"no parameter .beta. \(parameters: decay\)"), ("ema:decay=nan", r"\[0, 1\)"), ("", "empty")):
        with pytest.raises(ValueError, match=reason):
            parse_model_average(spec)
    with pytest.raises(ValueError, match="non-finite"):
        ModelAverage(0.5).update(torch.tensor([1.0, float("inf")]))
