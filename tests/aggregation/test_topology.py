"""Gossip topologies: mixing matrices against their definitions."""

from __future__ import annotations

import json

import networkx as nx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedge.aggregation.topology import make_topology, metropolis_hastings
from fedge.compression import SpecError


@given(n=st.integers(2, 24), p=st.floats(0.1, 0.9), seed=st.integers(0, 1000))
def test_metropolis_hastings_is_symmetric_and_doubly_stochastic(n: int, p: float, seed: int) -> None:
    graph = nx.gnp_random_graph(n, p, seed=seed)
    w = metropolis_hastings(nx.to_numpy_array(graph, nodelist=range(n), dtype=np.int64))
    assert np.allclose(w, w.T)
    assert np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1)
    assert (w >= -1e-12).all()
    for i, j in graph.edges:
        assert w[i, j] == pytest.approx(1 / (1 + max(graph.degree[i], graph.degree[j])))


@pytest.mark.parametrize("spec,n", [("ring", 16), ("torus", 16), ("exponential", 16), ("onepeer", 16),
                                    ("random:degree=4", 16), ("ring", 5), ("exponential", 10)])
def test_every_mixing_matrix_is_doubly_stochastic(spec: str, n: int) -> None:
    topology = make_topology(spec, n)
    for step in range(1, topology.period + 2):
        w = topology.mixing(step)
        assert np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1) and (w >= 0).all()
    assert 0 < topology.spectral_gap() <= 1
    json.dumps(topology.describe())


@pytest.mark.parametrize("n", [8, 16])
def test_one_peer_exponential_graph_averages_exactly_in_log2_n_steps(n: int) -> None:
    topology = make_topology("onepeer", n)
    tau = int(np.log2(n))
    assert topology.period == tau
    for first in (1, 3):  # any tau consecutive steps
        product = np.eye(n)
        for step in range(first, first + tau):
            product = topology.mixing(step) @ product
        assert np.abs(product - 1 / n).max() < 1e-12
    product = np.eye(n)
    for step in range(1, tau):  # one step short: not yet
        product = topology.mixing(step) @ product
    assert np.abs(product - 1 / n).max() > 1e-3
    assert make_topology("onepeer", 8).peers(0) == [1, 2, 4]


def test_spectral_gaps_order_as_theory_says() -> None:
    gaps = {spec: make_topology(spec, 16).spectral_gap() for spec in ("ring", "torus", "exponential")}
    assert gaps["ring"] == pytest.approx(0.051, abs=0.002)  # O(1/n^2)
    assert gaps["ring"] < gaps["torus"] < gaps["exponential"]
    assert make_topology("ring", 32).spectral_gap() < gaps["ring"]


def test_random_regular_graph_is_seeded_and_regular() -> None:
    a, b = make_topology("random:degree=4", 16, seed=7), make_topology("random:degree=4", 16, seed=7)
    assert np.array_equal(a.mixing(1), b.mixing(1))
    assert all(len(a.peers(i)) == 4 for i in range(16))
    assert not np.array_equal(a.mixing(1), make_topology("random:degree=4", 16, seed=8).mixing(1))


def test_impossible_topologies_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="r, c >= 3"):
        make_topology("torus", 8)
    with pytest.raises(ValueError, match="power of two"):
        make_topology("onepeer", 12)
    with pytest.raises(ValueError, match="does not exist"):
        make_topology("random:degree=3", 7)
    with pytest.raises(SpecError, match="unknown topology"):
        make_topology("star", 8)
    with pytest.raises(SpecError, match="has no parameter"):
        make_topology("ring:degree=2", 8)
