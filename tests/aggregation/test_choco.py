"""CHOCO-gossip against its definition, on small vectors."""

from __future__ import annotations

import pytest
import torch

from fedge.aggregation.choco import (
    choco_gossip_round,
    consensus_distance,
    consensus_step,
    naive_compressed_gossip_round,
)
from fedge.aggregation.topology import make_topology
from fedge.compression import make_codec


def _start(n: int, d: int = 64, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=gen) for _ in range(n)]


def test_consensus_step_is_the_definition() -> None:
    x, own = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.5])
    peers = {3: torch.tensor([1.5, 0.5]), 4: torch.tensor([0.5, 2.5])}
    out = consensus_step(x, own, peers, {3: 0.25, 4: 0.5}, gamma=0.8)
    expected = x + 0.8 * (0.25 * (peers[3] - own) + 0.5 * (peers[4] - own))
    assert torch.allclose(out, expected)


def test_choco_with_an_exact_codec_equals_plain_gossip() -> None:
    topology = make_topology("ring", 8)
    w = torch.tensor(topology.mixing(1), dtype=torch.float64)
    xs = _start(8)
    public = [torch.zeros_like(x) for x in xs]
    new_xs, new_public, _ = choco_gossip_round(xs, public, topology.mixing(1), 1.0, make_codec("none"))
    plain = (w @ torch.stack(xs).double()).float()
    assert torch.allclose(torch.stack(new_xs), plain, atol=1e-6)
    assert all(torch.equal(p, x) for p, x in zip(new_public, xs))  # x_hat catches x exactly


@pytest.mark.parametrize("spec,gamma", [("qsgd:bits=4,bucket=64,norm=max", 0.3), ("sign:bucket=64", 0.1)])
def test_choco_reaches_the_average_where_naive_compressed_gossip_does_not(spec: str, gamma: float) -> None:
    """Without public copies the compression error of every round stays in the models: the nodes
    agree in the end, but on a point far from the average they started with."""
    topology = make_topology("ring", 8)
    codec = make_codec(spec)
    gen = torch.Generator().manual_seed(1)
    start = _start(8, 512)
    mean = torch.stack(start).mean(0)
    xs, public = list(start), [torch.zeros(512) for _ in start]
    naive = list(start)
    for step in range(1, 201):
        xs, public, _ = choco_gossip_round(xs, public, topology.mixing(step), gamma, codec, gen)
        naive = naive_compressed_gossip_round(naive, topology.mixing(step), codec, gen)

    def error(models: list[torch.Tensor]) -> float:  # mean squared distance to the true average
        return float(sum((x - mean).pow(2).sum() for x in models) / len(models))

    initial = error(start)
    assert error(xs) < 1e-3 * initial
    assert error(naive) > 5e-3 * initial
    assert consensus_distance(naive) < 1e-3 * initial  # naive does agree, on the wrong point


def test_consensus_distance_definition() -> None:
    xs = [torch.tensor([0.0, 0.0]), torch.tensor([2.0, 0.0])]
    assert consensus_distance(xs) == 1.0  # each is at distance 1 from the mean (1, 0)
