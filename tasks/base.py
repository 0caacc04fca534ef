"""The task interface: what a federated or cloud training job needs to know about an ML problem.

A task owns its model builder, its data (a training pool that partitions split among clients and,
optionally, a central held-out split), its loss and its metrics. Everything else (local training,
aggregation, compression, export) is generic over tasks. ``docs/extending.md`` is the user's guide;
the two templates of ``fedge new`` are worked examples.

Data is any map-style :class:`torch.utils.data.Dataset` whose items are ``(input, target)`` pairs.
:class:`TensorData` (everything in memory) is the fast path: training indexes its tensors directly
instead of going through a ``DataLoader``; the built-in tasks all use it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

__all__ = ["Task", "TensorData", "as_tensor_data", "subset"]


@dataclass(frozen=True)
class TensorData(Dataset):
    """Inputs and targets held in memory: the fast path of training and evaluation.

    ``y`` holds integer class labels for a classification task, or float targets (any shape per
    sample) for regression and other tasks."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"{self.x.shape[0]} samples but {self.y.shape[0]} targets")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def to(self, device: torch.device) -> TensorData:
        """The same samples on ``device`` (itself when they are there): a GPU trainer moves its
        data once, not every batch."""
        if self.x.device == device and self.y.device == device:
            return self
        return TensorData(self.x.to(device), self.y.to(device))

    def subset(self, indices: torch.Tensor | Sequence[int]) -> TensorData:
        index = torch.as_tensor(indices, dtype=torch.long)
        return TensorData(self.x[index], self.y[index])


def as_tensor_data(data: Dataset, limit: int | None = None) -> TensorData:
    """The first ``limit`` (default all) items of any map-style dataset stacked in memory: for
    what needs tensors (ONNX calibration and golden inputs, a device's cached partition)."""
    if isinstance(data, TensorData):
        return data if limit is None else data.subset(range(min(limit, len(data))))
    count = len(data) if limit is None else min(limit, len(data))  # type: ignore[arg-type]
    if count == 0:
        raise ValueError("the dataset is empty")
    items = [data[i] for i in range(count)]
    return TensorData(torch.stack([torch.as_tensor(x) for x, _ in items]),
                      torch.stack([torch.as_tensor(y) for _, y in items]))


def subset(data: Dataset, indices: Sequence[int]) -> Dataset:
    """``indices`` of ``data``: a :class:`TensorData` stays one (the fast path), anything else is a
    :class:`torch.utils.data.Subset`."""
    if isinstance(data, TensorData):
        return data.subset(indices)
    return Subset(data, [int(i) for i in indices])


class Task(ABC):
    """An ML problem: a model, a training pool to partition, optional central held-out data, a loss
    and metrics.

    Subclass it and implement :meth:`build_model` and :meth:`train_pool`; everything else has a
    default. A classification task sets :attr:`num_classes` (targets are integer labels, the loss
    is cross-entropy, the metric accuracy); any other task leaves it ``None`` and gets mean squared
    error for both unless it overrides :meth:`loss` and :meth:`metrics`. Constructor keyword
    arguments with defaults become spec parameters (``my_app.task:MyTask:hidden=64``).
    """

    #: Canonical spec string, e.g. ``digits`` or ``my_app.task:HousingTask:hidden=64``. Set by the
    #: registry when a task does not set it itself; every process rebuilds the task from it.
    spec: str = ""
    #: Shape of one input sample (without the batch dimension): what a device's own data must have.
    input_shape: tuple[int, ...] = ()
    #: Number of classes of a classification task; ``None`` for regression and other targets.
    num_classes: int | None = None
    #: Shape of one target of a non-classification task (``()`` for a scalar); unused otherwise.
    target_shape: tuple[int, ...] = ()
    #: The metric (a key of :meth:`metrics`, or ``loss``) that drives progress, the plot and the
    #: stop rule; ``None``: ``accuracy`` for classification, ``mse`` otherwise.
    metric: str | None = None
    #: Whether larger values of :attr:`metric` are better; ``None``: true only for accuracy.
    greater_is_better: bool | None = None
    #: Name of the exported ONNX model's output.
    output_name: str | None = None

    # -- what every task implements --------------------------------------------------------------
    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (seed torch's RNG before calling to make it reproducible)."""

    @abstractmethod
    def train_pool(self) -> Dataset:
        """All training samples; partitions are disjoint subsets of this pool."""

    # -- defaults a task may override ------------------------------------------------------------
    def test_data(self) -> Dataset | None:
        """Central held-out samples never used for training, or ``None`` when the coordinator has
        none (the data lives on the devices): the run then evaluates on the devices."""
        return None

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch: what local training minimises and what evaluation reports."""
        if self.is_classification:
            return nn.functional.cross_entropy(outputs, targets)
        return nn.functional.mse_loss(outputs.reshape(targets.shape), targets.to(outputs.dtype))

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Metrics of the model's outputs on a whole evaluation split (all of its outputs at once).

        Each value must be a mean over examples: federated evaluation combines the devices'
        values weighted by their example counts."""
        if self.is_classification:
            return {"accuracy": float((outputs.argmax(dim=1) == targets).float().mean())}
        error = outputs.reshape(targets.shape) - targets.to(outputs.dtype)
        return {"mse": float(error.pow(2).mean()), "mae": float(error.abs().mean())}

    def example_input(self) -> torch.Tensor:
        """One batch of one real input: ONNX export traces it (the batch dimension is dynamic)."""
        data = self.test_data()
        x, _ = (data if data is not None and len(data) else self.train_pool())[0]  # type: ignore[arg-type]
        return torch.as_tensor(x).unsqueeze(0).to(torch.float32)

    def partition_labels(self, pool: Dataset) -> Sequence[int] | None:
        """Class labels of ``pool`` for label-skew partitioners (Dirichlet, pathological); ``None``
        when the task has none, and then only ``iid`` partitioning is possible. Override it to
        partition by something else (a binned regression target, a user id)."""
        if not self.is_classification:
            return None
        if isinstance(pool, TensorData):
            return tuple(int(v) for v in pool.y.tolist())
        return tuple(int(pool[i][1]) for i in range(len(pool)))  # type: ignore[arg-type]

    def partition(self, partition_id: int, num_partitions: int, partitioning: str) -> Dataset:
        """The training samples of one client under a partitioning spec (``fedge.tasks.partition``)."""
        from fedge.tasks.partition import partition_indices

        pool = self.train_pool()
        labels = self.partition_labels(pool)
        return subset(pool, partition_indices(labels, partitioning, num_partitions, partition_id,
                                              size=len(pool)))  # type: ignore[arg-type]

    # -- derived facts ---------------------------------------------------------------------------
    @property
    def is_classification(self) -> bool:
        return self.num_classes is not None

    @property
    def primary_metric(self) -> str:
        return self.metric or ("accuracy" if self.is_classification else "mse")

    @property
    def maximize(self) -> bool:
        """Whether the primary metric improves upwards."""
        if self.greater_is_better is not None:
            return self.greater_is_better
        return self.primary_metric == "accuracy"

    @property
    def output(self) -> str:
        return self.output_name or ("logits" if self.is_classification else "prediction")

    def check_targets(self, y: torch.Tensor, where: str = "data") -> None:
        """Raise ``ValueError`` if ``y`` cannot be this task's targets (a device's own file)."""
        if self.is_classification:
            if y.dtype.is_floating_point or y.ndim != 1:
                raise ValueError(f"{where}: y must be integer class labels of shape (N,), got {y.dtype} "
                                 f"{tuple(y.shape)}")
            if len(y) and (int(y.min()) < 0 or int(y.max()) >= int(self.num_classes or 0)):
                raise ValueError(f"{where}: labels must be in 0..{self.num_classes - 1} for task {self.spec!r}, "
                                 f"found {int(y.min())}..{int(y.max())}")
            return
        if tuple(y.shape[1:]) != tuple(self.target_shape):
            raise ValueError(f"{where}: y has shape {tuple(y.shape)}; task {self.spec!r} needs "
                             f"(N{''.join(', ' + str(d) for d in self.target_shape)})")
        if y.dtype.is_floating_point and not bool(torch.isfinite(y).all()):
            raise ValueError(f"{where}: y holds NaN or infinite values")
