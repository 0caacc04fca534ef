"""The pieces under secure aggregation: ring packing, the shared grid, Shamir, the neighbourhood graph."""

from __future__ import annotations

import itertools
import os

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.privacy.errors import MaskedInputError, ProtocolError, RingError, ShareError
from fedge.privacy.neighbourhood import auto_neighbours, harary_neighbours
from fedge.privacy.prg import mask
from fedge.privacy.ring import pack_ring, packed_ring_size, ring_bits, unpack_ring
from fedge.privacy.shamir import combine_secret, split_secret
from fedge.privacy.shared_grid import SharedGrid


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 32), count=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_ring_packing_round_trips_at_every_width(bits: int, count: int, seed: int) -> None:
    values = np.random.default_rng(seed).integers(0, 1 << bits, count, dtype=np.uint64).astype(np.uint32)
    packed = pack_ring(values, bits)
    assert len(packed) == packed_ring_size(count, bits) == (count * bits + 7) // 8
    assert np.array_equal(unpack_ring(packed, count, bits), values)


def test_ring_sizing_and_bad_lengths() -> None:
    assert ring_bits(4, 100) == 11 and ring_bits(4, 1000) == 14 and ring_bits(4, 1) == 4
    assert ring_bits(4, 100, headroom_bits=3) == 14
    with pytest.raises(RingError):
        ring_bits(8, 2**25)
    with pytest.raises(MaskedInputError, match="expected 5 bytes"):
        unpack_ring(b"\x00" * 4, 4, 10)


def test_masks_are_deterministic_per_seed_and_differ_across_seeds() -> None:
    seed = os.urandom(32)
    assert np.array_equal(mask(seed, 1000, 11), mask(seed, 1000, 11))
    assert not np.array_equal(mask(seed, 1000, 11), mask(os.urandom(32), 1000, 11))
    assert mask(seed, 1000, 11).max() < 2**11


def test_shared_grid_is_unbiased_and_decodes_the_weighted_mean() -> None:
    grid = SharedGrid(bits=4, clip=1.0, weight_cap=1000)
    rng = np.random.default_rng(0)
    updates = [rng.uniform(-0.8, 0.8, 2000) for _ in range(3)]
    weights = [100, 400, 1000]
    draws = 200
    level_sum = sum(grid.quantize(u, w, rng).astype(np.int64) for _ in range(draws) for u, w in zip(updates, weights))
    mean, _ = grid.weighted_mean(level_sum, 3 * draws)
    exact = sum(w * u for u, w in zip(updates, weights)) / sum(weights)
    # the weights come back exactly; the values within the stochastic rounding's noise
    assert grid.decode_sum(level_sum, 3 * draws)[1] == draws * sum(weights)
    assert np.abs(mean - exact).max() < 0.02
    assert grid.weight_digits == 3  # 1000 < 16^3


def test_shared_grid_clips_and_refuses_non_finite() -> None:
    grid = SharedGrid(bits=2, clip=0.5)
    levels = grid.quantize(np.array([-9.0, 9.0]), 1, np.random.default_rng(0))
    assert list(levels[:2]) == [0, 3]
    with pytest.raises(ValueError, match="non-finite"):
        grid.quantize(np.array([np.nan]), 1, np.random.default_rng(0))
    with pytest.raises(RingError):
        SharedGrid(bits=4, clip=float("inf"))


def test_shamir_any_threshold_subset_rebuilds_and_fewer_do_not() -> None:
    secret = os.urandom(32)
    shares = list(enumerate(split_secret(secret, 3, 5), start=1))
    for subset in itertools.combinations(shares, 3):
        assert combine_secret(list(subset), 3) == secret
    assert combine_secret(shares[:2] + [(3, os.urandom(32))], 3) != secret
    with pytest.raises(ShareError, match="cannot rebuild"):
        combine_secret(shares[:2], 3)
    with pytest.raises(ShareError, match="same holder"):
        combine_secret([shares[0], shares[0], shares[1]], 3)


@pytest.mark.parametrize("devices, degree", [(10, 9), (10, 4), (40, 12), (41, 13), (90, 16)])
def test_harary_neighbourhoods(devices: int, degree: int) -> None:
    nodes = list(range(1000, 1000 + devices))
    graph = harary_neighbours(nodes, degree, seed=3)
    assert graph == harary_neighbours(nodes, degree, seed=3)
    assert graph != harary_neighbours(nodes, degree, seed=4) or degree == devices - 1
    g = nx.Graph([(a, b) for a, peers in graph.items() for b in peers])
    assert all(a in graph[b] for a, peers in graph.items() for b in peers)  # symmetric
    assert min(d for _, d in g.degree) >= degree and max(d for _, d in g.degree) <= degree + 1
    assert nx.is_connected(g)
    if devices <= 41:  # a Harary graph H(k, n) is k-connected: no k - 1 dropouts split it
        assert nx.node_connectivity(g) >= degree


def test_auto_neighbours_grow_logarithmically() -> None:
    assert auto_neighbours(10) == 9 and auto_neighbours(17) == 16
    assert auto_neighbours(100) == 28 and auto_neighbours(1000) == 40 and auto_neighbours(100_000) == 68
    with pytest.raises(ProtocolError):
        harary_neighbours([1], 1, 0)


def test_a_shared_support_is_the_same_for_everyone_and_changes_with_its_seed() -> None:
    from fedge.privacy.keys import RoundContext
    from fedge.privacy.plan import SecAggPlan

    def plan(seed: int) -> SecAggPlan:
        return SecAggPlan(RoundContext(b"r", 1), (1, 2, 3), SharedGrid(4, 1.0), 250, graph_seed=1, model_size=1000,
                          support_seed=seed)

    support = plan(5).support
    assert support is not None and len(support) == 250 and len(set(support.tolist())) == 250
    assert np.array_equal(support, np.sort(support)) and support.max() < 1000
    assert np.array_equal(support, plan(5).support) and not np.array_equal(support, plan(6).support)
    assert SecAggPlan(RoundContext(b"r", 1), (1, 2), SharedGrid(4, 1.0), 10, graph_seed=1).support is None
    with pytest.raises(ProtocolError, match="impossible"):
        SecAggPlan(RoundContext(b"r", 1), (1, 2), SharedGrid(4, 1.0), 10, graph_seed=1, model_size=5)


@pytest.mark.parametrize("devices, neighbours", [(5, 3), (21, 7), (41, 13), (40, 13), (10, 4)])
def test_the_threshold_is_a_strict_majority_of_every_devices_real_neighbours(devices: int, neighbours: int) -> None:
    """Privacy II, M2. With an odd neighbour count and an odd number of devices each device has k + 1
    neighbours; a threshold taken from k was exactly half of them, so a coordinator could collect a
    device's seed shares from one half and its key shares from the other. The threshold, default
    or checked, is a strict majority of every device's real neighbourhood."""
    from fedge.privacy.keys import RoundContext
    from fedge.privacy.plan import SecAggPlan

    plan = SecAggPlan(RoundContext(b"r", 1), tuple(range(1, devices + 1)), SharedGrid(4, 1.0), 10, graph_seed=3,
                      neighbours=neighbours)
    for node in plan.participants:
        assert 2 * plan.reconstruction_threshold > len(plan.neighbours_of(node)), node
    with pytest.raises(ProtocolError, match="not a majority"):  # an explicit threshold of half is refused
        SecAggPlan(RoundContext(b"r", 1), tuple(range(1, devices + 1)), SharedGrid(4, 1.0), 10, graph_seed=3,
                   neighbours=neighbours, threshold=plan.degree // 2)
    # against a coordinator that may lie (the consistency round): above two thirds, by default and
    # checked, and the quorum too (privacy audit 2, N3)
    issued = SecAggPlan(RoundContext(b"r", 1), tuple(range(1, devices + 1)), SharedGrid(4, 1.0), 10, graph_seed=3,
                        neighbours=neighbours, consistency=True)
    for node in issued.participants:
        assert 3 * issued.reconstruction_threshold > 2 * len(issued.neighbours_of(node)), node
    assert 3 * issued.consistency_quorum > 2 * devices
    if 2 * issued.degree // 3 > issued.degree // 2:  # a majority that is not two thirds exists
        with pytest.raises(ProtocolError, match="two thirds"):
            SecAggPlan(RoundContext(b"r", 1), tuple(range(1, devices + 1)), SharedGrid(4, 1.0), 10, graph_seed=3,
                       neighbours=neighbours, threshold=2 * issued.degree // 3, consistency=True)
