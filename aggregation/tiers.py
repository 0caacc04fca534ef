"""The hop between a leaf coordinator and the root: what goes up, and how the root takes it in once.

A leaf coordinator aggregates its own devices' updates into its step's released
:class:`~fedge.aggregation.partial.Partial` and sends the root one compressed mean, weighted by the
leaf's total weight. Compressing a mean the root then averages again loses what the codec drops,
round after round, unless the leaf keeps it: the leaf plays DoubleSqueeze's server (Tang et al.,
ICML 2019), sending ``C(mean + e)`` and keeping ``e <- mean + e - D(C(mean + e))``, the same error
feedback a device keeps (``fedge.compression.error_feedback``), so the sum of what it sent tracks
the sum of its true means. (The residual is in mean units: a leaf whose weight swings between
rounds carries it at the next round's weight; DoubleSqueeze assumes equal weights.)

The root merges one :class:`LeafSum` per (round, leaf) with :meth:`Partial.merge`; a second one for
the same key is a retry or a duplicate and is refused (:class:`RootInbox`), so a leaf that restarts
and resends is never counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedge.aggregation.partial import Partial, PartialError
from fedge.compression import Codec

__all__ = ["LeafKey", "LeafSum", "LeafUplink", "RootInbox"]


@dataclass(frozen=True)
class LeafKey:
    """Which root round (or version) a leaf's sum belongs to, and which leaf sent it."""

    round: int
    leaf: str

    def __post_init__(self) -> None:
        if self.round < 1 or not self.leaf:
            raise PartialError(f"a leaf key needs a round >= 1 and a leaf name, got {self.round}, {self.leaf!r}")


@dataclass(frozen=True)
class LeafSum:
    """One leaf's step, as the root receives it: the encoded mean (``payload``, empty when no
    device's update is in it) and what it is over."""

    key: LeafKey
    payload: bytes
    weight: float
    count: int
    #: devices planned into the leaf's step (secure aggregation's group, DP's planned devices)
    planned: int = 0
    noised: bool = False

    def partial(self, codec: Codec, numel: int, seed: int) -> Partial:
        """The sum as the root merges it: the payload decoded with the round's codec (validated in
        full by the decoder: a bad payload raises ``PayloadError`` before anything is merged)."""
        if not self.payload:
            return Partial.empty(numel, planned=self.planned)
        mean = codec.for_round(self.key.round, seed).decode(self.payload, numel)
        if not torch.isfinite(mean).all():
            raise PartialError(f"leaf {self.key.leaf}'s mean holds NaN or infinite values")
        return Partial.of_mean(mean, self.weight, self.count, planned=self.planned, noised=self.noised)


class LeafUplink:
    """A leaf's side of the hop: its released partials, compressed with its own error feedback."""

    def __init__(self, codec: Codec, numel: int, seed: int, leaf: str) -> None:
        self.codec, self.numel, self.seed, self.leaf = codec, numel, seed, leaf
        #: what the payloads have not carried yet (the leaf's error feedback), in mean units
        self.residual = torch.zeros(numel, dtype=torch.float32)

    def encode(self, partial: Partial, number: int, generator: torch.Generator | None = None) -> LeafSum:
        """The leaf's sum for root round ``number``. A step with no update sends no mean (weight 0)
        and keeps its residual for the next one."""
        key = LeafKey(number, self.leaf)
        if partial.is_empty:
            return LeafSum(key, b"", 0.0, 0, partial.planned, partial.noised)
        memory = self.codec.make_memory(self.codec.for_round(number, self.seed), self.numel,
                                        {"residual": self.residual})
        payload = memory.encode(partial.mean(), generator)
        self.residual = memory.residual
        return LeafSum(key, payload, partial.weight, partial.count, partial.planned, partial.noised)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        residual = state["residual"]
        if residual.numel() != self.numel:
            raise ValueError(f"a leaf residual of {residual.numel()} values for a model of {self.numel}")
        self.residual = residual.to(torch.float32).flatten().clone()


@dataclass
class RootInbox:
    """The root's side for one round: each leaf's sum taken once, merged into one partial."""

    round: int
    codec: Codec
    numel: int
    seed: int
    merged: Partial = field(init=False)
    leaves: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.merged = Partial.empty(self.numel)

    def take(self, leaf_sum: LeafSum) -> bool:
        """Merge ``leaf_sum``; False (nothing merged) for another round's or a second one from a
        leaf already taken: a resend after a leaf restarted is not counted twice."""
        if leaf_sum.key.round != self.round or leaf_sum.key.leaf in self.leaves:
            return False
        self.merged = self.merged.merge(leaf_sum.partial(self.codec, self.numel, self.seed))
        self.leaves.add(leaf_sum.key.leaf)
        return True
