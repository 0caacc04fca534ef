"""CHOCO-gossip math (Koloskova, Stich, Jaggi, ICML 2019, https://arxiv.org/abs/1902.00340).

Every node i keeps a public copy x̂_i of its own model and of each peer's. Per round it sends
q_i = Q(x_i − x̂_i); every holder of x̂_i (the node itself and its peers) applies x̂_i += D(q_i), so all
copies of x̂_i stay bit-for-bit equal; then x_i ← x_i + γ Σ_j W_ij (x̂_j − x̂_i). What Q did not carry
stays in x_i − x̂_i and is sent later: the public copy is the error memory, so no separate error
feedback is needed (adding one would count the error twice). With an exact codec and γ = 1 this is
plain gossip averaging, x_i ← Σ_j W_ij x_j.

Without public copies, compressing the models themselves (x_i ← Σ_j W_ij D(Q(x_j)) for j ≠ i) leaves
a compression error in every round that is never corrected: :func:`naive_compressed_gossip_round`
exists to show that it stalls where CHOCO converges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedge.compression import Codec

__all__ = [
    "choco_gossip_round",
    "consensus_distance",
    "consensus_step",
    "naive_compressed_gossip_round",
]


def consensus_step(
    x: torch.Tensor, own: torch.Tensor, peers: Mapping[int, torch.Tensor], weights: Mapping[int, float], gamma: float
) -> torch.Tensor:
    """x + γ Σ_j W_ij (x̂_j − x̂_i) over the peers ``j`` with weight ``weights[j]`` (the self weight
    contributes nothing: x̂_i − x̂_i = 0)."""
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    out = x.clone()
    for j, w in weights.items():
        if w:
            out.add_(peers[j] - own, alpha=gamma * float(w))
    return out


def choco_gossip_round(
    xs: Sequence[torch.Tensor], public: Sequence[torch.Tensor], mixing: np.ndarray, gamma: float, codec: Codec,
    generator: torch.Generator | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bytes]]:
    """One CHOCO-gossip round over all n nodes (for tests and the benchmark's pure simulation):
    returns new models, new public copies and the payloads sent."""
    n = len(xs)
    payloads = [codec.encode(xs[i] - public[i], generator) for i in range(n)]
    new_public = [public[i] + codec.decode(payloads[i], xs[i].numel()) for i in range(n)]
    new_xs = [
        consensus_step(xs[i], new_public[i], dict(enumerate(new_public)),
                       {j: float(mixing[i, j]) for j in range(n) if j != i}, gamma)
        for i in range(n)
    ]
    return new_xs, new_public, payloads


def naive_compressed_gossip_round(
    xs: Sequence[torch.Tensor], mixing: np.ndarray, codec: Codec, generator: torch.Generator | None = None
) -> list[torch.Tensor]:
    """Gossip that compresses the models themselves, with no public copies: x_i ← W_ii x_i + Σ_{j≠i}
    W_ij D(Q(x_j)). The compression error of every round stays in the models."""
    n = len(xs)
    received = [codec.decode(codec.encode(x, generator), x.numel()) for x in xs]
    return [
        xs[i] * float(mixing[i, i]) + sum(float(mixing[i, j]) * received[j] for j in range(n) if j != i)
        for i in range(n)
    ]


def consensus_distance(xs: Sequence[torch.Tensor]) -> float:
    """Ξ² = (1/n) Σ_i ‖x_i − x̄‖² (Kong et al., ICML 2021), in float64."""
    stacked = torch.stack([x.to(torch.float64) for x in xs])
    return float((stacked - stacked.mean(0)).pow(2).sum(1).mean())
