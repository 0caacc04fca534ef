"""Top-k per tensor (``scope=tensor``): every tensor keeps its own top ratio."""

import pytest
import torch

from fedge.compression.errors import PayloadError
from fedge.compression.registry import make_codec

SIZES = (144, 16, 4608, 32, 32768, 64, 640, 10)  # the digits CNN's tensors


def _kept_per_tensor(dense: torch.Tensor) -> list[int]:
    counts, offset = [], 0
    for size in SIZES:
        counts.append(int((dense[offset: offset + size] != 0).sum()))
        offset += size
    return counts


@pytest.mark.parametrize("spec", ["topk:ratio=0.01,scope=tensor", "topk:ratio=0.01,sample=0.05,scope=tensor",
                                  "dgc:ratio=0.01,sample=0.05,scope=tensor"])
def test_each_tensor_keeps_its_own_top_ratio(spec: str) -> None:
    x = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(0))
    x[-650:] *= 100  # a classifier whose update dwarfs the rest: a whole-model top-k keeps only it
    codec = make_codec(spec).for_model(SIZES).for_round(10, 0)
    decoded = codec.decode(codec.encode(x, torch.Generator().manual_seed(1)), x.numel())
    kept, wanted = _kept_per_tensor(decoded), [2, 1, 47, 1, 328, 1, 7, 1]  # ceil(1% of each), at least 1
    if "sample" in spec:  # a sampled threshold may fall short of k, never over it; every tensor keeps some
        assert all(1 <= k <= w for k, w in zip(kept, wanted)) and sum(kept) >= 0.9 * sum(wanted), kept
    else:
        assert kept == wanted
    offset = 0
    for size in SIZES:  # within a tensor, the largest magnitudes are the ones kept
        piece, kept = x[offset: offset + size], decoded[offset: offset + size] != 0
        assert piece.abs()[kept].min() >= piece.abs()[~kept].max()
        offset += size
    whole = make_codec(spec.replace(",scope=tensor", "")).for_round(10, 0)
    assert _kept_per_tensor(whole.decode(whole.encode(x), x.numel()))[:6] == [0] * 6


def test_the_spec_round_trips_and_a_whole_model_decoder_refuses_the_extra_elements() -> None:
    codec = make_codec("dgc:ratio=0.01,sample=0.05,scope=tensor+qsgd:bits=4")
    assert make_codec(codec.spec).spec == codec.spec and "scope=tensor" in codec.spec
    bound = codec.for_model(SIZES).for_round(10, 0)
    x = torch.randn(sum(SIZES))
    assert bound.decode(bound.encode(x), x.numel()).shape == x.shape
    exact = make_codec("topk:ratio=0.01,scope=tensor+qsgd:bits=4").for_model(SIZES)
    with pytest.raises(PayloadError, match="exceed"):  # 388 elements (one more per small tensor) > 383
        make_codec("topk:ratio=0.01+qsgd:bits=4").decode(exact.encode(x), sum(SIZES))
    with pytest.raises(ValueError, match="for_model"):
        make_codec("topk:ratio=0.01,scope=tensor").encode(torch.randn(100))
    with pytest.raises(ValueError, match="NaN"):
        bound.encode(torch.full((sum(SIZES),), float("nan")))
