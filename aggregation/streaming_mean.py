"""Streaming weighted mean: decode each client payload straight into one running sum.

Flower's built-in strategies receive every reply, then aggregate; their memory grows with the number
of clients. Here each update is decoded (and validated) into a single accumulator as soon as it
arrives and its payload can be dropped right after, so the coordinator's memory is O(model) whatever the number
of clients: one accumulator plus one decoded temporary.

The accumulator is exact (:class:`~fedge.aggregation.exact_sum.ExactSum`): the same replies give the
same bits in any order, so the order in which devices happen to finish never changes a run.
"""

from __future__ import annotations

import math

import torch

from fedge.aggregation.exact_sum import ExactScalar, ExactSum, check_term
from fedge.aggregation.partial import Partial

__all__ = ["StreamingMean", "check_weight"]


def check_weight(weight: float) -> None:
    """An aggregation weight is a finite positive number (a NaN weight would poison every later sum)."""
    if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
        raise ValueError(f"weight must be a finite positive number, got {weight!r}")


class StreamingMean:
    """Running ``sum_k w_k * x_k`` and ``sum_k w_k`` over vectors of ``numel`` float32 elements.

    The first reply is held as it came (float32, unscaled): the mean of one reply is that reply, bit
    for bit (a root over one leaf then holds the flat run's model exactly). The second turns it into
    the exact sum in the same memory, so both never coexist; from there on each reply is added
    exactly; ``mean`` is the exact sum divided by the correctly rounded total weight in float64,
    rounded once to float32 (``sum``: that mean times the weight): one result for one set of
    replies, whatever their order."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self._first: torch.Tensor | None = None
        self._exact: ExactSum | None = None
        self._weights = ExactScalar()

    @property
    def count(self) -> int:
        return self._weights.count

    @property
    def total_weight(self) -> float:
        return self._weights.value

    def add(self, vector: torch.Tensor, weight: float) -> None:
        """Accumulate a decoded vector (the caller decodes first: a payload that does not decode
        never reaches the sum). A bad weight, size or value leaves the running mean as it was."""
        check_weight(weight)
        flat = vector.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"vector has {flat.numel()} elements, expected {self.numel}")
        if self.count == 0:
            check_term(flat, weight)
            self._first = flat.to(torch.float32, copy=True).contiguous()
        else:
            if self._exact is None:
                assert self._first is not None
                check_term(flat, weight)  # a refused second reply leaves the first as it was
                self._exact, self._first = ExactSum.from_float32(self._first, self._weights.terms[0]), None
            self._exact.add(flat, weight)
        self._weights.add(weight)

    def ready(self, minimum: int) -> bool:
        """Whether enough vectors were accumulated to release a result (``min-replies``)."""
        return self.count >= minimum

    def mean(self) -> torch.Tensor:
        """The weighted mean as float32; raises if nothing was accumulated."""
        return self.partial().mean()

    def sum(self) -> torch.Tensor:
        """The weighted sum ``sum_k w_k x_k`` (EASGD's center moves by the sum of elastic differences,
        not their mean); raises if nothing was accumulated."""
        return self.partial().sum()

    def partial(self) -> Partial:
        """What was accumulated, as the step's partial aggregate."""
        if self.count == 0:
            return Partial.empty(self.numel)
        if self._exact is None:
            assert self._first is not None
            return Partial.of_mean(self._first.clone(), self.total_weight, 1)
        # the mean, from the exact sum in float64, rounded once (and one model-sized tensor)
        total = self.total_weight
        return Partial.of_mean(self._exact.value(scale=1.0 / total), total, self.count)
