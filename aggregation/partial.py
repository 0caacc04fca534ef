"""A step's partial aggregate: what a set of updates adds up to, and what it is over.

Every feature that works on a step's updates without looking at each one (secure aggregation reveals
only their sum, distributed or central DP noises it, a leaf coordinator forwards it to a root) hands
this one type along a chain, instead of wrapping the algorithm's accumulator in proxies with side
fields. It is the value a layer receives and returns (``Layer.release``). (A leaf does not send its
root a ``Partial``: its bridge sends the change of the leaf's model as one device's update, weighted
by the leaf's devices' weights, which is what the root's FedAvg needs; ``fedge.protocol.leaf``.)

A partial holds its sum either as the weighted sum itself (a streaming mean's accumulator) or as the
weighted mean (what secure aggregation unmasks, what DP releases): whichever the producer computed,
so that ``mean()`` and ``sum()`` give exactly the producer's numbers, bit for bit, and nothing is
divided and multiplied back on the way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Accumulator", "Partial", "PartialError"]


class PartialError(ValueError):
    """Two partial aggregates that cannot be combined, or a result asked of an empty one."""


@dataclass(frozen=True)
class Partial:
    """``sum_k w_k x_k`` over ``count`` updates of ``numel`` values with total weight ``weight``.

    Exactly one of ``total`` (the weighted sum) and ``average`` (the weighted mean) is set when
    ``count > 0`` or the partial is ``noised``; both are None for an empty one."""

    numel: int
    #: the weighted sum, when the producer held a sum
    total: torch.Tensor | None = None
    #: the weighted mean, when the producer computed a mean (unmasking, a noised release)
    average: torch.Tensor | None = None
    #: the summed weights (example counts, capped; 1 per update for unweighted algorithms)
    weight: float = 0.0
    #: updates in the sum
    count: int = 0
    #: the nodes whose updates are in the sum, when known (secure aggregation: the survivors)
    members: tuple[int, ...] = ()
    #: devices planned into the step: under distributed DP each added 1/planned of the noise
    planned: int = 0
    #: noise was added: the partial is released whatever the count (whether noise appears must
    #: never depend on who answered), and it is the last transformation a privacy ledger counts
    noised: bool = False

    def __post_init__(self) -> None:
        for name in ("total", "average"):
            value = getattr(self, name)
            if value is not None and (value.dim() != 1 or value.numel() != self.numel):
                raise PartialError(f"a partial's {name} is a flat vector of {self.numel} values, got "
                                   f"shape {tuple(value.shape)}")
        if self.total is not None and self.average is not None:
            raise PartialError("a partial holds its sum or its mean, not both")
        if self.count < 0 or not self.weight >= 0:
            raise PartialError(f"a partial's count and weight are >= 0, got {self.count} and {self.weight}")

    # -- making one ---------------------------------------------------------------------------
    @classmethod
    def empty(cls, numel: int, planned: int = 0) -> Partial:
        return cls(numel, planned=planned)

    @classmethod
    def of_sum(cls, total: torch.Tensor, weight: float, count: int, **fields: object) -> Partial:
        return cls(total.numel(), total=total, weight=float(weight), count=count, **fields)  # type: ignore[arg-type]

    @classmethod
    def of_mean(cls, average: torch.Tensor, weight: float, count: int, **fields: object) -> Partial:
        return cls(average.numel(), average=average, weight=float(weight), count=count, **fields)  # type: ignore[arg-type]

    def replace(self, **fields: object) -> Partial:
        return dataclasses.replace(self, **fields)  # type: ignore[arg-type]

    # -- reading it ---------------------------------------------------------------------------
    @property
    def is_empty(self) -> bool:
        return self.total is None and self.average is None

    def ready(self, minimum: int) -> bool:
        """Whether the step may release it (``min-replies``); a noised partial always is."""
        return self.noised or self.count >= minimum

    def mean(self) -> torch.Tensor:
        """The weighted mean; :class:`PartialError` when nothing was added."""
        if self.average is not None:
            return self.average
        if self.total is None or self.weight <= 0:
            raise PartialError("no update was accumulated")
        return self.total / self.weight

    def sum(self) -> torch.Tensor:
        """The weighted sum (a copy); :class:`PartialError` when nothing was added."""
        if self.total is not None:
            return self.total.clone()
        if self.average is None:
            raise PartialError("no update was accumulated")
        return self.average * self.weight


class Accumulator(Protocol):
    """What an algorithm adds a step's updates into (a streaming mean, a robust rule)."""

    @property
    def count(self) -> int: ...

    def add(self, vector: torch.Tensor, weight: float) -> None: ...

    def partial(self) -> Partial: ...
