"""Gossip topologies and their mixing matrices (pure: numpy and networkx, no Flower, no I/O).

A topology fixes, for every step, a doubly stochastic mixing matrix W over n nodes: node i mixes
in the models of the j with W_ij > 0. Doubly stochastic keeps the average model unchanged by
mixing; the spectral gap 1 − |λ2(W)| says how fast mixing reaches consensus (ring: O(1/n²);
exponential graph: O(1/log n)).

Specs (the grammar codecs use): ``ring``, ``torus``, ``exponential``, ``onepeer``,
``random:degree=4[,seed=S]``.

* undirected graphs (ring, 2-D torus, static exponential graph, random d-regular via
  ``networkx.random_regular_graph``) get Metropolis–Hastings weights
  W_ij = 1/(1 + max(deg_i, deg_j)) on edges, W_ii = 1 − Σ_{j≠i} W_ij (symmetric, doubly stochastic);
* ``onepeer`` is the one-peer time-varying exponential graph (Ying et al., NeurIPS 2021,
  https://arxiv.org/abs/2110.13363): n = 2^τ, at step t node i mixes with i + 2^((t−1) mod τ) with
  weight ½. Each W(t) is directed; the product over any τ consecutive steps is exactly (1/n)·11ᵀ.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from fedge.compression.spec import build_from_spec

__all__ = ["Topology", "make_topology", "metropolis_hastings"]


def metropolis_hastings(adjacency: np.ndarray) -> np.ndarray:
    """Metropolis–Hastings mixing weights of an undirected graph (0/1 symmetric adjacency)."""
    a = np.asarray(adjacency)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"adjacency must be square, got shape {a.shape}")
    if not np.isin(a, (0, 1)).all() or not np.array_equal(a, a.T) or np.diag(a).any():
        raise ValueError("adjacency must be symmetric 0/1 with a zero diagonal")
    degree = a.sum(axis=1)
    w = np.zeros(a.shape, dtype=np.float64)
    rows, cols = np.nonzero(a)
    w[rows, cols] = 1.0 / (1.0 + np.maximum(degree[rows], degree[cols]))
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


@dataclass(frozen=True)
class Topology:
    name: str
    spec: str
    n: int
    matrices: tuple[np.ndarray, ...] = field(repr=False)  # one per step of the period

    @property
    def period(self) -> int:
        return len(self.matrices)

    def mixing(self, step: int) -> np.ndarray:
        """W(step) for 1-based steps (time-varying graphs cycle through their period)."""
        if step < 1:
            raise ValueError(f"steps are 1-based, got {step}")
        return self.matrices[(step - 1) % self.period].copy()

    def in_neighbours(self, i: int, step: int) -> list[int]:
        row = self.mixing(step)[i]
        return [j for j in range(self.n) if j != i and row[j] > 0]

    def peers(self, i: int) -> list[int]:
        """Every node whose model node i mixes in at some step: the public copies it keeps."""
        return sorted({j for s in range(1, self.period + 1) for j in self.in_neighbours(i, s)})

    def spectral_gap(self) -> float:
        """1 − |λ2| of W (of the product over one period for a time-varying graph)."""
        if self.n == 1:
            return 1.0
        product = np.eye(self.n)
        for w in self.matrices:
            product = w @ product
        moduli = np.sort(np.abs(np.linalg.eigvals(product)))[::-1]
        return float(max(0.0, 1.0 - moduli[1]))

    def describe(self) -> dict[str, Any]:
        degrees = [len(self.peers(i)) for i in range(self.n)]
        return {"name": self.name, "spec": self.spec, "n": self.n, "period": self.period,
                "spectral_gap": self.spectral_gap(), "spectral_gap_per": "period" if self.period > 1 else "step",
                "peers_min": min(degrees), "peers_max": max(degrees),
                "edges": sum(degrees) // (1 if self.period > 1 else 2)}


def _static(name: str, spec: str, graph: nx.Graph, n: int) -> Topology:
    if n > 1 and not nx.is_connected(graph):
        raise ValueError(f"topology {spec} over {n} nodes is not connected")
    adjacency = nx.to_numpy_array(graph, nodelist=range(n), dtype=np.int64)
    np.fill_diagonal(adjacency, 0)
    return Topology(name, spec, n, (metropolis_hastings(np.minimum(adjacency, 1)),))


def _ring(n: int) -> Topology:
    return _static("ring", "ring", nx.cycle_graph(n) if n > 2 else nx.path_graph(n), n)


def _torus(n: int) -> Topology:
    rows = max((r for r in range(3, math.isqrt(n) + 1) if n % r == 0), default=0)
    if rows < 3 or n // rows < 3:
        raise ValueError(f"a 2-D torus needs n = r x c with r, c >= 3; {n} is not (use ring or exponential)")
    grid = nx.grid_2d_graph(rows, n // rows, periodic=True)
    graph = nx.convert_node_labels_to_integers(grid, ordering="sorted")
    return _static("torus", "torus", graph, n)


def _exponential(n: int) -> Topology:
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    hop = 1
    while hop < n:
        graph.add_edges_from((i, (i + hop) % n) for i in range(n) if (i + hop) % n != i)
        hop *= 2
    return _static("exponential", "exponential", graph, n)


def _onepeer(n: int) -> Topology:
    tau = n.bit_length() - 1
    if n < 2 or n != 1 << tau:
        raise ValueError(f"the one-peer exponential graph needs n a power of two >= 2, got {n}")
    matrices = []
    for k in range(tau):
        w = 0.5 * np.eye(n)
        for i in range(n):
            w[i, (i + (1 << k)) % n] += 0.5
        matrices.append(w)
    return Topology("onepeer", "onepeer", n, tuple(matrices))


def _random(n: int, degree: int = 4, seed: int = 42) -> Topology:
    if not 0 < degree < n or (n * degree) % 2:
        raise ValueError(f"a random {degree}-regular graph over {n} nodes does not exist (need 0 < d < n, n*d even)")
    for attempt in range(100):
        graph = nx.random_regular_graph(degree, n, seed=seed + attempt)
        if nx.is_connected(graph):
            return _static("random", f"random:degree={degree},seed={seed + attempt}", graph, n)
    raise ValueError(f"no connected random {degree}-regular graph over {n} nodes in 100 draws")


def make_topology(spec: str, n: int, seed: int = 42) -> Topology:
    """The topology a spec names over ``n`` nodes (``seed`` is the default seed of random graphs)."""
    if n < 1:
        raise ValueError(f"a topology needs n >= 1, got {n}")
    registry: dict[str, Callable[..., Topology]] = {
        "ring": lambda: _ring(n), "torus": lambda: _torus(n), "exponential": lambda: _exponential(n),
        "onepeer": lambda: _onepeer(n), "random": lambda degree=4, seed=seed: _random(n, degree, seed),
    }
    topology = build_from_spec(spec, registry, family="topology")
    assert isinstance(topology, Topology)
    return topology
