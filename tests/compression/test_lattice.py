"""The lattice wire format: exact round trips and a named error for every malformed payload."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.compression.errors import PayloadError
from fedge.compression.lattice import CHANGE, SNAPSHOT, decode_lattice, encode_lattice


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**31) + 1, 2**31 - 1), min_size=1, max_size=300), st.integers(0, 5))
def test_snapshot_round_trip_is_exact(values: list[int], version: int) -> None:
    n = np.array(values, dtype=np.int64)
    message = decode_lattice(encode_lattice(SNAPSHOT, n.size, -1, version, n), n.size)
    assert np.array_equal(message.values, n) and message.version == version and message.base == -1


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(0, 9999), st.integers(-5000, 5000).filter(bool), max_size=200))
def test_change_round_trip_is_exact(change: dict[int, int]) -> None:
    idx = np.array(sorted(change), dtype=np.int64)
    values = np.array([change[i] for i in idx], dtype=np.int64)
    message = decode_lattice(encode_lattice(CHANGE, 10_000, 3, 7, values, idx), 10_000)
    assert np.array_equal(message.indices, idx) and np.array_equal(message.values, values)
    assert (message.base, message.version) == (3, 7)


def test_small_values_take_few_bits_and_outliers_are_exact() -> None:
    rng = np.random.default_rng(0)
    n = rng.integers(-3, 4, size=100_000)
    n[[5, 500, 50_000]] = [10**6, -(10**7), 300]
    payload = encode_lattice(SNAPSHOT, n.size, -1, 1, n)
    assert len(payload) < n.size * 3 / 8 + 100  # 3 bits per coordinate plus three escapes
    assert np.array_equal(decode_lattice(payload, n.size).values, n)


def test_malformed_payloads_are_refused_with_a_reason() -> None:
    idx, values = np.array([1, 5, 9]), np.array([2, -1, 40])
    good = encode_lattice(CHANGE, 10, 0, 1, values, idx)
    with pytest.raises(PayloadError, match="coordinates"):
        decode_lattice(good, 11)
    with pytest.raises(PayloadError, match="shorter than its header"):
        decode_lattice(good[:10], 10)
    with pytest.raises(PayloadError, match="magic"):
        decode_lattice(b"XXXX" + good[4:], 10)
    for position in range(4, len(good)):  # every flipped byte is caught (header check or checksum)
        corrupt = bytearray(good)
        corrupt[position] ^= 0x5A
        with pytest.raises(PayloadError):
            decode_lattice(bytes(corrupt), 10)
    with pytest.raises(ValueError):
        encode_lattice(SNAPSHOT, 10, -1, 1, np.zeros(9))


def test_a_dense_change_costs_rice_gaps_and_values_not_bytes() -> None:
    """A catch-up over many versions touches a quarter of the model with small values: Rice-coded
    gaps (~3.3 bits each at 25% density, a varint takes 8) and Rice-coded values (geometric with a
    sign here: entropy 3.9 bits, Rice 4.3)."""
    rng = np.random.default_rng(2)
    idx = np.sort(rng.choice(200_000, 50_000, replace=False))
    values = rng.geometric(0.3, idx.size) * rng.choice([-1, 1], idx.size)
    values[[7, 70]] = [123_456, -99_999]
    payload = encode_lattice(CHANGE, 200_000, 2, 12, values, idx)
    assert payload[5] == 0  # Rice-coded values (width field 0)
    assert len(payload) * 8 / idx.size < 3.3 + 4.4 + 0.1
    message = decode_lattice(payload, 200_000)
    assert np.array_equal(message.indices, idx) and np.array_equal(message.values, values)


def test_a_snapshot_of_a_mostly_unchanged_lattice_goes_sparse_and_decodes_dense() -> None:
    """Early in a run most of ``n`` is still zero: a new device gets the non-zero entries only."""
    n = np.zeros(100_000, dtype=np.int64)
    rng = np.random.default_rng(3)
    touched = rng.choice(n.size, 3_000, replace=False)
    n[touched] = rng.integers(-300, 300, touched.size) | 1  # odd: never zero
    payload = encode_lattice(SNAPSHOT, n.size, -1, 4, n)
    assert payload[4] == 2 and len(payload) < 3_000 * (7 + 11) / 8 + 200  # gaps + values, not 100k codes
    message = decode_lattice(payload, n.size)
    assert message.kind == SNAPSHOT and message.base == -1 and message.version == 4
    assert np.array_equal(message.values, n) and np.array_equal(message.indices, np.arange(n.size))
    dense = rng.integers(-300, 300, n.size)  # a dense lattice stays a dense snapshot
    assert encode_lattice(SNAPSHOT, n.size, -1, 9, dense)[4] == SNAPSHOT
