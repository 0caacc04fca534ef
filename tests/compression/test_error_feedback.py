import torch
from hypothesis import given
from hypothesis import strategies as st

from fedge.compression import ErrorFeedback, make_codec


@given(
    spec=st.sampled_from(["fp16", "qsgd:bits=2,bucket=8", "qsgd:bits=4,norm=max", "qsgd:bits=3,bucket=5"]),
    steps=st.integers(1, 6),
    n=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_nothing_is_lost_only_delayed(spec: str, steps: int, n: int, seed: int) -> None:
    """sum_t D(c_t) + e_T == sum_t g_t (Stich et al. 2018; Karimireddy et al. 2019)."""
    codec = make_codec(spec)
    ef = ErrorFeedback(codec, n)
    gen = torch.Generator().manual_seed(seed)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * 10
        total += g.double()
        sent += codec.decode(ef.encode(g, gen), n).double()
    assert torch.allclose(sent + ef.residual.double(), total, atol=1e-3 * (1 + total.abs().max()))


def test_residual_shrinks_error_over_rounds() -> None:
    """With a contractive codec, the running sum of what was sent tracks the sum of updates."""
    n = 2048
    codec = make_codec("qsgd:bits=3,bucket=512,norm=max")
    ef = ErrorFeedback(codec, n)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(n, generator=gen)
    sent = sum(codec.decode(ef.encode(g, gen), n) for _ in range(50))
    relative = (sent - 50 * g).norm() / (50 * g).norm()
    assert relative < 0.05  # one 3-bit sample alone is off by ~45%


def test_residual_must_match_size() -> None:
    import pytest

    with pytest.raises(ValueError):
        ErrorFeedback(make_codec("fp16"), 4, residual=torch.zeros(5))


def test_contraction_estimate_flags_noisy_codecs() -> None:
    from fedge.compression.error_feedback import relative_error

    assert relative_error(make_codec("qsgd:bits=4,norm=max"), 4096) < 0.1
    assert relative_error(make_codec("qsgd:bits=4,norm=l2"), 4096) > 1.0
    assert relative_error(make_codec("none"), 4096) == 0.0
