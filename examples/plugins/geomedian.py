"""An aggregator from outside Fedge: the geometric median of a step's updates (Weiszfeld's
algorithm; Pillutla et al., "Robust Aggregation for Federated Learning", 2022), robust to a
minority of arbitrary updates. Use it as ``aggregator = "geomedian:iterations=8"``."""

from __future__ import annotations

from typing import Any

import torch

from fedge.aggregation import Aggregator, register_aggregator


class GeometricMedian(Aggregator):
    def __init__(self, numel: int, capacity: int, iterations: int = 8) -> None:
        super().__init__(numel, capacity)
        if iterations < 1:
            raise ValueError("geomedian needs iterations >= 1")
        self.iterations = iterations
        self._rows: list[torch.Tensor] = []
        self._weights: list[float] = []

    @property
    def spec(self) -> str:
        return f"geomedian:iterations={self.iterations}"

    @property
    def count(self) -> int:
        return len(self._rows)

    def add(self, vector: torch.Tensor, weight: float) -> None:
        if self.count >= self.capacity:
            raise ValueError(f"{self.spec} holds at most {self.capacity} updates per step")
        self._rows.append(vector.to(torch.float32).clone())
        self._weights.append(float(weight))

    def result(self) -> torch.Tensor:
        rows = torch.stack(self._rows).to(torch.float64)
        weights = torch.tensor(self._weights, dtype=torch.float64)
        median = (weights[:, None] * rows).sum(0) / weights.sum()
        for _ in range(self.iterations):
            distances = (rows - median).norm(dim=1).clamp_min(1e-12)
            beta = weights / distances
            median = (beta[:, None] * rows).sum(0) / beta.sum()
        return median.to(torch.float32)

    def chosen(self) -> list[int] | None:
        return None

    @classmethod
    def memory_bytes(cls, numel: int, capacity: int, **params: Any) -> int:
        return 4 * numel * capacity + 8 * numel * (capacity + 2)  # the rows, their float64 copy, the median


register_aggregator("geomedian", GeometricMedian)
