"""The time-correlated sparsifier (``tcs``): values on a support both sides know, without indices."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.compression import HEADER_SIZE, PayloadError, SpecError, make_codec
from fedge.compression.lattice import CHANGE, SNAPSHOT, change_support, encode_lattice
from fedge.compression.shared_support import SharedSupportCodec, support_digest

N = 2000


def _support(seed: int, size: int, n: int = N) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(n, size, replace=False)).astype(np.int64)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), size=st.integers(0, N), extra=st.floats(0.001, 0.2))
def test_the_support_goes_exactly_and_the_extras_are_the_largest_outside_it(seed: int, size: int, extra: float) -> None:
    """fp32 values, exact top-k: the support's values arrive exactly, and the extras are the
    ceil(extra n) largest magnitudes outside it (or all of them), nothing else moves."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
    support = _support(seed, size)
    codec = make_codec(f"tcs:extra={extra},sample=0").with_support(support)
    out = codec.decode(codec.encode(x), N).numpy()
    np.testing.assert_array_equal(out[support], x.numpy()[support])
    outside = np.setdiff1d(np.arange(N), support)
    k = min(outside.size, int(np.ceil(float(np.float32(extra)) * N)))  # the ratio as the header carries it
    sent = outside[out[outside] != 0]
    assert sent.size == k
    if k:
        largest = np.sort(np.abs(x.numpy()[outside]))[-k:]
        np.testing.assert_array_equal(np.sort(np.abs(out[sent])), largest)


def test_the_support_costs_no_index_bytes() -> None:
    """Against top-k sending the same coordinates with indices: the support's values, 4 bytes each
    (fp32), and nothing for where they go."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(0))
    support = _support(1, 200)
    payload = make_codec("tcs:extra=0.01,sample=0").with_support(support).encode(x)
    extras_index_bytes = len(payload) - HEADER_SIZE - 24 - HEADER_SIZE - 4 * (200 + 20)
    assert 0 < extras_index_bytes <= 2 * 20  # 20 extra indices, at most a 2-byte varint gap each
    topk = make_codec("topk:ratio=0.11").encode(x)  # 220 coordinates with their indices
    assert len(payload) < len(topk)


def test_a_payload_decoded_on_another_support_is_refused_not_misdecoded() -> None:
    x = torch.randn(N, generator=torch.Generator().manual_seed(0))
    codec = make_codec("tcs:extra=0.01+qsgd:bits=4")
    payload = codec.with_support(_support(1, 200)).encode(x)
    for other in (_support(2, 200), _support(1, 199), None):
        with pytest.raises(PayloadError, match="did not get the same downlink"):
            codec.with_support(other).decode(payload, N)
    with pytest.raises(PayloadError, match="reaches index"):
        codec.with_support(_support(1, 200)).decode(codec.with_support(_support(1, 200)).encode(x[:100]), 100)


def test_an_extra_inside_the_support_is_refused() -> None:
    """A forged payload (valid CRC) whose extras repeat a support coordinate, counted twice if accepted."""
    import struct

    from fedge.compression.index_sets import encode_index_set
    from fedge.compression.wire import pack_payload

    support = np.array([3, 7, 9], dtype=np.int64)
    codec = SharedSupportCodec(extra=0.01, sample=0.0).with_support(support)
    scheme, index_bytes = encode_index_set(np.array([7]))
    body = (struct.pack("<QIIQ", 3, support_digest(support), 1, scheme << 56 | len(index_bytes)) + index_bytes
            + make_codec("none").encode(torch.ones(4)))
    forged = pack_payload(codec.codec_id, N, codec.params_bytes(), body)
    with pytest.raises(PayloadError, match="inside the shared support"):
        codec.decode(forged, N)
    honest = (struct.pack("<QIIQ", 3, support_digest(support), 1, scheme << 56 | len(index_bytes))
              + encode_index_set(np.array([8]))[1] + make_codec("none").encode(torch.ones(4)))
    decoded = codec.decode(pack_payload(codec.codec_id, N, codec.params_bytes(), honest), N)
    assert decoded[[3, 7, 8, 9]].tolist() == [1] * 4 and float(decoded.abs().sum()) == 4


def test_bound_payloads_survive_fuzzing_with_payload_errors_only() -> None:
    support = _support(3, 300)
    codec = make_codec("tcs:extra=0.02+qsgd:bits=4,bucket=64").with_support(support)
    genuine = codec.encode(torch.randn(N, generator=torch.Generator().manual_seed(5)))
    rng = random.Random(0)
    for _ in range(400):
        data = bytearray(genuine)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            out = codec.decode(bytes(data), N)
        except PayloadError:
            continue
        assert bool(torch.isfinite(out).all())


def test_specs_and_support_validation() -> None:
    codec = make_codec("tcs:extra=0.02,sample=0.1+qsgd:bits=3")
    assert make_codec(codec.spec) == codec and codec.shares_support
    assert not make_codec("topk:ratio=0.1").shares_support
    assert make_codec("topk:ratio=0.1").with_support(np.arange(5)) == make_codec("topk:ratio=0.1")
    for bad in ("tcs:extra=0", "tcs:extra=1.5", "tcs:sample=2", "tcs:extra=0.1+topk:ratio=0.1"):
        with pytest.raises(SpecError):
            make_codec(bad)
    for bad_support in (np.array([3, 1]), np.array([1, 1]), np.array([-1, 2]), np.array([0.5])):
        with pytest.raises(ValueError, match="shared support"):
            codec.with_support(bad_support)
    assert support_digest(np.array([1, 2], dtype=np.int64)) != support_digest(np.array([1, 3], dtype=np.int64))


def test_change_support_is_a_changes_indices_and_nothing_for_a_snapshot() -> None:
    indices, values = np.array([2, 5, 11]), np.array([1, -3, 2])
    change = encode_lattice(CHANGE, 20, 4, 5, values, indices)
    np.testing.assert_array_equal(change_support(change, 20), indices)
    snapshot = encode_lattice(SNAPSHOT, 20, -1, 5, np.arange(20))
    assert change_support(snapshot, 20).size == 0
