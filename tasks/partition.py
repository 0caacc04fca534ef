"""Client partitions of a task's training pool, built by ``flwr_datasets`` partitioners on local data.

Partitioning specs: ``iid``, ``dirichlet:alpha=0.5`` (label skew, Hsu et al. 2019),
``pathological:classes=2`` (each client sees only a few classes, McMahan et al. 2017). A ``seed``
parameter is accepted by all three (default 42). Nothing here downloads anything: the partitioners
run over a ``datasets.Dataset`` built in memory from the pool's labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache, partial

import numpy as np
from datasets import ClassLabel, Dataset, Features, Value
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    IidPartitioner,
    PathologicalPartitioner,
    Partitioner,
)

from fedge.compression.errors import SpecError
from fedge.compression.spec import build_from_spec, parse_spec

__all__ = ["partition_indices", "validate_partitioning"]


def _iid(num_partitions: int, seed: int = 42) -> tuple[Partitioner, int]:
    return IidPartitioner(num_partitions=num_partitions), seed


def _dirichlet(
    num_partitions: int, alpha: float = 0.5, min_size: int = 10, seed: int = 42
) -> tuple[Partitioner, int]:
    if alpha <= 0:
        raise SpecError(f"dirichlet alpha must be > 0, got {alpha}")
    partitioner = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        alpha=alpha,
        min_partition_size=min_size,
        self_balancing=False,
        shuffle=True,
        seed=seed,
    )
    return partitioner, seed


def _pathological(num_partitions: int, classes: int = 2, seed: int = 42) -> tuple[Partitioner, int]:
    # "first-deterministic" guarantees every class is used at least once; the random mode can leave
    # a class to no client at all.
    partitioner = PathologicalPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        num_classes_per_partition=classes,
        class_assignment_mode="first-deterministic",
        shuffle=True,
        seed=seed,
    )
    return partitioner, seed


_REGISTRY = {"iid": _iid, "dirichlet": _dirichlet, "pathological": _pathological}


def validate_partitioning(spec: str) -> None:
    """Raise :class:`SpecError` early (in the CLI) for a partitioning spec that cannot work."""
    _make(spec, 2)


def _make(spec: str, num_partitions: int) -> tuple[Partitioner, int]:
    bound = {name: partial(factory, num_partitions) for name, factory in _REGISTRY.items()}
    return build_from_spec(spec, bound, family="partitioning")


@lru_cache(maxsize=16)
def _all_partitions(labels: tuple[int, ...], spec: str, num_partitions: int) -> tuple[np.ndarray, ...]:
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    partitioner, seed = _make(spec, num_partitions)
    num_classes = max(labels) + 1 if labels else 1
    # IidPartitioner splits contiguous shards: shuffle the pool order first so shards are random.
    order = np.random.default_rng(seed).permutation(len(labels))
    features = Features({"index": Value("int64"), "label": ClassLabel(num_classes=num_classes)})
    dataset = Dataset.from_dict(
        {"index": order.tolist(), "label": [labels[i] for i in order]}, features=features
    )
    partitioner.dataset = dataset
    return tuple(
        np.asarray(partitioner.load_partition(pid)["index"], dtype=np.int64)
        for pid in range(num_partitions)
    )


def partition_indices(
    labels: Sequence[int] | None, spec: str, num_partitions: int, partition_id: int, size: int | None = None
) -> np.ndarray:
    """Indices into the pool (whose class labels are ``labels``) that belong to ``partition_id``.

    A task without class labels (``labels=None``, e.g. regression) has a pool of ``size`` samples
    and can only be split ``iid``: the label-skew partitioners have nothing to skew."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} outside 0..{num_partitions - 1}")
    if labels is None:
        if parse_spec(spec)[0] != "iid":
            raise SpecError(f"partitioning {spec!r} skews class labels, and this task has none: use 'iid', "
                            "or give the task a partition_labels() (e.g. binned targets)")
        if size is None:
            raise ValueError("partition_indices needs the pool size when there are no labels")
        labels = (0,) * size
    return _all_partitions(tuple(int(v) for v in labels), spec, num_partitions)[partition_id]
