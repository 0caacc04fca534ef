"""Streaming weighted mean: decode each client payload straight into one running sum.

Flower's built-in strategies receive every reply, then aggregate; their memory grows with the number
of clients. Here each update is decoded (and validated) into a single accumulator as soon as it
arrives and its payload can be dropped right after, so the coordinator's memory is O(model) whatever the number
of clients: one accumulator plus one decoded temporary.
"""

from __future__ import annotations

import math

import torch

from fedge.aggregation.partial import Partial

__all__ = ["StreamingMean", "check_weight"]


def check_weight(weight: float) -> None:
    """An aggregation weight is a finite positive number (a NaN weight would poison every later sum)."""
    if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
        raise ValueError(f"weight must be a finite positive number, got {weight!r}")


class StreamingMean:
    """Running ``sum_k w_k * x_k`` and ``sum_k w_k`` over vectors of ``numel`` float32 elements."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self._sum = torch.zeros(numel, dtype=torch.float32)
        self.total_weight = 0.0
        self.count = 0

    def add(self, vector: torch.Tensor, weight: float) -> None:
        """Accumulate a decoded vector (the caller decodes first: a payload that does not decode
        never reaches the sum). A bad weight or size leaves the running mean as it was."""
        check_weight(weight)
        flat = vector.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"vector has {flat.numel()} elements, expected {self.numel}")
        self._accumulate(flat, weight)

    def ready(self, minimum: int) -> bool:
        """Whether enough vectors were accumulated to release a result (``min-replies``)."""
        return self.count >= minimum

    def mean(self) -> torch.Tensor:
        """The weighted mean as float32; raises if nothing was accumulated."""
        if self.count == 0:
            raise ValueError("no update was accumulated")
        if self.count == 1:
            return self._sum.clone()  # held unscaled: the reply itself
        return self._sum / self.total_weight

    def sum(self) -> torch.Tensor:
        """The weighted sum ``sum_k w_k x_k`` (EASGD's center moves by the sum of elastic differences,
        not their mean); raises if nothing was accumulated."""
        if self.count == 0:
            raise ValueError("no update was accumulated")
        return self._sum * self.total_weight if self.count == 1 else self._sum.clone()

    def partial(self) -> Partial:
        """What was accumulated, as the step's partial aggregate (the sum itself, not a copy: the
        step is closing)."""
        if self.count == 0:
            return Partial.empty(self.numel)
        if self.count == 1:
            return Partial.of_mean(self._sum, self.total_weight, 1)
        return Partial.of_sum(self._sum, self.total_weight, self.count)

    def _accumulate(self, flat: torch.Tensor, weight: float) -> None:
        # float32, like the model: a float64 sum was measured 3x slower per reply here, and reply
        # order changes the float32 result only by rounding (~1e-7 relative per reply).
        # The first reply is held unscaled while it is the only one: the mean of one reply is that
        # reply, bit for bit, where (w * x) / w can round off by an ulp (a root over one leaf then
        # holds the flat run's model exactly). The second scales it: w * x, as adding it would have.
        if self.count == 0:
            self._sum.copy_(flat)
        else:
            if self.count == 1:
                self._sum.mul_(self.total_weight)
            self._sum.add_(flat, alpha=weight)
        self.total_weight += weight
        self.count += 1
