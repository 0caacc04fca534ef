import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compression import HEADER_SIZE, SpecError, available_codecs, make_codec
from compression.qsgd import QSGDCodec

SPECS = ["none", "fp16", "qsgd:bits=2", "qsgd:bits=3,bucket=7", "qsgd:bits=4,bucket=512,norm=l2",
         "qsgd:bits=4,norm=max", "qsgd:bits=8,bucket=64"]

vectors = st.integers(1, 700).flatmap(
    lambda n: st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=n, max_size=n)
)


@pytest.mark.parametrize("spec", SPECS)
@given(values=vectors)
def test_round_trip_shape_and_exact_size(spec: str, values: list[float]) -> None:
    codec = make_codec(spec)
    x = torch.tensor(values, dtype=torch.float32)
    payload = codec.encode(x, torch.Generator().manual_seed(1))
    assert len(payload) == codec.wire_bytes(x.numel()) == HEADER_SIZE + codec.body_size(x.numel())
    decoded = codec.decode(payload, x.numel())
    assert decoded.shape == (x.numel(),) and decoded.dtype == torch.float32
    assert torch.isfinite(decoded).all()


@given(values=vectors)
def test_fp32_is_lossless(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    codec = make_codec("none")
    assert torch.equal(codec.decode(codec.encode(x), x.numel()), x)


@given(values=vectors)
def test_fp16_error_is_half_precision_rounding(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    codec = make_codec("fp16")
    decoded = codec.decode(codec.encode(x), x.numel())
    assert torch.allclose(decoded, x, rtol=2**-10, atol=2**-14)


@pytest.mark.parametrize("bits,bucket,norm", [(2, 16, "l2"), (4, 8, "l2"), (4, 32, "max"), (8, 5, "max")])
def test_qsgd_is_unbiased(bits: int, bucket: int, norm: str) -> None:
    codec = QSGDCodec(bits=bits, bucket=bucket, norm=norm)
    x = torch.randn(40, generator=torch.Generator().manual_seed(0)) * 3
    gen = torch.Generator().manual_seed(2)
    trials = 4000
    mean = torch.stack([codec.decode(codec.encode(x, gen), 40) for _ in range(trials)]).mean(0)
    # Per-element std of one sample is at most scale/s; the mean of `trials` samples shrinks it.
    scale = x.norm() if norm == "l2" else x.abs().max()
    tolerance = 5 * float(scale) / codec.levels / trials**0.5
    assert torch.allclose(mean, x, atol=tolerance), (mean - x).abs().max()


@pytest.mark.parametrize("norm", ["l2", "max"])
def test_qsgd_values_lie_on_the_quantization_grid(norm: str) -> None:
    codec = QSGDCodec(bits=4, bucket=16, norm=norm)
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    decoded = codec.decode(codec.encode(x), 64).view(4, 16)
    scales = x.view(4, 16).norm(dim=1) if norm == "l2" else x.view(4, 16).abs().amax(dim=1)
    levels = decoded / (scales[:, None] / codec.levels)
    assert torch.allclose(levels, levels.round(), atol=1e-3)
    assert levels.abs().max() <= codec.levels + 1e-3
    # never flips a sign
    assert ((decoded * x.view(4, 16)) >= 0).all()


def test_qsgd_variance_bound() -> None:
    """E|Q(v)-v|^2 <= min(d/s^2, sqrt(d)/s) |v|^2 per bucket (Alistarh et al., Lemma 3.1)."""
    d, codec = 256, QSGDCodec(bits=3, bucket=256, norm="l2")
    s = codec.levels
    x = torch.randn(d)
    gen = torch.Generator().manual_seed(5)
    err = torch.stack([(codec.decode(codec.encode(x, gen), d) - x).pow(2).sum() for _ in range(500)]).mean()
    assert err <= min(d / s**2, d**0.5 / s) * x.pow(2).sum() * 1.05


def test_zero_vector_and_zero_buckets() -> None:
    codec = QSGDCodec(bits=4, bucket=4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.0])
    assert codec.decode(codec.encode(torch.zeros(9)), 9).abs().sum() == 0
    assert torch.isfinite(codec.decode(codec.encode(x), 7)).all()


def test_compression_ratio_of_4_bit_qsgd() -> None:
    codec = make_codec("qsgd:bits=4,bucket=512")
    n = 38_282
    assert 4 * n / codec.wire_bytes(n) > 7.8


def test_encode_refuses_non_finite_input() -> None:
    with pytest.raises(ValueError, match="NaN or infinite"):
        make_codec("qsgd:bits=4").encode(torch.tensor([1.0, float("nan")]))


def test_spec_strings() -> None:
    assert make_codec("qsgd:bits=4").spec == "qsgd:bits=4,bucket=512,norm=max"
    assert make_codec(make_codec("qsgd:bits=2,bucket=64,norm=max").spec) == make_codec(
        "qsgd:bucket=64,bits=2,norm=max"
    )
    assert make_codec("fp32").spec == "none"
    assert {"none", "fp16", "qsgd"} <= set(available_codecs())
    for bad in ["", "zip", "qsgd:bits", "qsgd:bits=four", "qsgd:bits=9", "qsgd:bits=4,bits=4",
                "qsgd:bucket=0", "qsgd:norm=l1", "qsgd:speed=3"]:
        with pytest.raises(SpecError):
            make_codec(bad)
