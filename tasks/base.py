"""The task interface: what a federated or cloud training job needs to know about an ML problem.

A task owns its model builder, its data (a training pool that partitions split among clients and a
held-out test split that only evaluation sees) and how to partition. Everything else (local training,
aggregation, compression) is generic over tasks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Task", "TensorData"]


@dataclass(frozen=True)
class TensorData:
    """Features and integer labels held in memory (all Fedge tasks are small enough per client)."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"{self.x.shape[0]} samples but {self.y.shape[0]} labels")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, indices: torch.Tensor | list[int]) -> TensorData:
        index = torch.as_tensor(indices, dtype=torch.long)
        return TensorData(self.x[index], self.y[index])


class Task(ABC):
    """An ML problem: a model family plus a training pool and a held-out test split."""

    #: Canonical spec string, e.g. ``digits`` or ``synthetic:dim=64,hidden=256``.
    spec: str
    num_classes: int
    #: Shape of one input sample (without the batch dimension): what a device's own data must have.
    input_shape: tuple[int, ...]

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (seed torch's RNG before calling to make it reproducible)."""

    @abstractmethod
    def train_pool(self) -> TensorData:
        """All training samples; partitions are disjoint subsets of this pool."""

    @abstractmethod
    def test_data(self) -> TensorData:
        """Held-out samples never used for training: every accuracy Fedge reports is measured here."""

    def partition(self, partition_id: int, num_partitions: int, partitioning: str) -> TensorData:
        """The training samples of one client under a partitioning spec (see ``tasks.partition``)."""
        from fedge.tasks.partition import partition_indices

        pool = self.train_pool()
        labels = tuple(int(v) for v in pool.y.tolist())
        return pool.subset(partition_indices(labels, partitioning, num_partitions, partition_id))

