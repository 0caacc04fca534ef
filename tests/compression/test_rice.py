"""Rice coding and the index-set coding that chooses between it and varints."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedge.compression import rice
from fedge.compression.errors import PayloadError
from fedge.compression.index_sets import RICE, VARINT, decode_index_set, encode_index_set
from fedge.compression.registry import make_codec
from fedge.compression.varint import encode_indices


@given(k=st.integers(0, 40), data=st.data())
def test_rice_round_trip(k: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(0, 2 ** (k + 10)), max_size=200))  # quotients < 1024
    array = np.array(values, dtype=np.uint64)
    data = rice.encode(array, k)
    assert len(data) == rice.encoded_size(array, k)
    np.testing.assert_array_equal(rice.decode(data, len(values), k), array)


def test_rice_layout_is_unary_then_remainders() -> None:
    # 5 = 0b101 with k=1: quotient 2 -> bits 0,0,1; remainder 1. 2: quotient 1 -> 0,1; remainder 0.
    assert rice.encode(np.array([5, 2]), 1) == bytes([0b10100, 0b01])


def test_best_parameter_is_near_the_entropy_of_geometric_gaps() -> None:
    rng = np.random.default_rng(0)
    for density in (0.01, 0.1):
        gaps = rng.geometric(density, 100_000).astype(np.uint64) - 1
        k = rice.best_parameter(gaps)
        assert k == min(range(20), key=lambda j: rice.encoded_size(gaps, j))
        entropy = -(density * math.log2(density) + (1 - density) * math.log2(1 - density)) / density
        assert rice.encoded_size(gaps, k) * 8 / gaps.size < 1.03 * entropy


@pytest.mark.parametrize(("data", "count", "k", "match"), [
    (b"\x01", 9, 0, "cannot hold"),
    (b"\x03\x00", 2, 0, "trailing bytes"),
    (b"\x07", 2, 0, "3 unary codes"),
    (b"\x01\x02", 1, 1, "non-zero padding"),
    (b"\x01", 1, 63, "out of range"),
    (b"\x01", 0, 0, "no value"),
])
def test_rice_refuses_malformed_sections(data: bytes, count: int, k: int, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        rice.decode(data, count, k)


@given(data=st.data(), limit=st.integers(1, 5000))
def test_index_sets_round_trip_and_never_exceed_varints(data: st.DataObject, limit: int) -> None:
    chosen = data.draw(st.sets(st.integers(0, limit - 1), max_size=min(limit, 400)))
    indices = np.array(sorted(chosen), dtype=np.int64)
    scheme, encoded = encode_index_set(indices)
    assert len(encoded) <= len(encode_indices(indices))
    np.testing.assert_array_equal(decode_index_set(scheme, encoded, indices.size, limit), indices)


def test_rice_is_chosen_where_it_is_smaller() -> None:
    rng = np.random.default_rng(1)
    indices = np.sort(rng.choice(1_000_000, 10_000, replace=False))
    scheme, encoded = encode_index_set(indices)
    assert scheme == RICE and len(encoded) * 8 / indices.size < 8.3  # varint: 10.3 bits at 1%
    assert encode_index_set(np.array([3]))[0] == VARINT  # one small index: the varint byte wins


def test_index_sets_refuse_out_of_range_and_unknown_schemes() -> None:
    scheme, encoded = encode_index_set(np.array([10, 500, 999]))
    with pytest.raises(PayloadError, match="out of range"):
        decode_index_set(scheme, encoded, 3, 999)
    with pytest.raises(PayloadError, match="unknown index coding"):
        decode_index_set(7, encoded, 3, 1000)


def test_sparse_payloads_use_rice_and_decode_exactly() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    codec = make_codec("topk:ratio=0.01")
    payload = codec.encode(x)
    kept = codec.decode(payload, x.numel())
    top = x.abs().topk(1000).indices
    torch.testing.assert_close(kept[top], x[top])
    # 1000 fp32 values (4,000 B + headers) and Rice-coded indices near 8.1 bits each, not 10.3
    assert len(payload) < 4_000 + 1_080 + 200
