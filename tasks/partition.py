"""Client partitions of a task's training pool, built by ``flwr_datasets`` partitioners on local data.

Partitioning specs: ``iid``, ``dirichlet:alpha=0.5`` (label skew, Hsu et al. 2019),
``pathological:classes=2`` (each client sees only a few classes, McMahan et al. 2017; NIID-Bench's
"#C = k", label skew by sort and partition), ``quantity:beta=0.5`` (quantity skew, NIID-Bench's
"q ~ Dir(beta)": each client's share of the pool drawn from a Dirichlet, the samples spread over
labels as in ``iid``), ``natural`` (one partition per distinct label: a task whose
``partition_labels`` are who wrote each sample, Shakespeare's speaking roles; as many partitions as
the pool has such ids). A ``seed`` parameter is accepted by all of them (default 42). Nothing here downloads anything: the partitioners
run over a ``datasets.Dataset`` built in memory from the pool's labels.

Importing flwr-datasets costs ~1.8 CPU-s (its package imports its plotting helpers: matplotlib and
seaborn), paid once in every process that partitions: each Ray actor of a simulation, each
SuperNode's first ClientApp. A run can share one drawing instead: with a cache directory (the
``cache_dir`` argument, or the ``FEDGE_PARTITION_CACHE`` environment variable that Fedge's launcher
sets for the processes of a run and fills before they start), the indices of every partition are
stored there once, under a key that holds the labels themselves, the spec and the count, and later
processes read them without importing flwr-datasets. Behind the run's directory sits the
per-machine cache (``fedge.tasks.array_cache``, ``$FEDGE_CACHE_DIR``), under the same key, so a
later run of the same split (the CLI's preflight included) draws nothing and imports nothing. A
cached file that is not a drawing of its labels' pool (one array per partition, disjoint in-range
indices) is drawn again; the directories are trusted as the run directory and the user's cache are.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import TYPE_CHECKING

import numpy as np

from fedge.compression.errors import SpecError
from fedge.compression.spec import build_from_spec, parse_spec
from fedge.tasks.array_cache import CacheEntryInvalid, cached_arrays

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner

__all__ = ["CACHE_ENV", "partition_indices", "validate_partitioning"]


#: a directory where the processes of one run share their partition drawing (see the module docstring)
CACHE_ENV = "FEDGE_PARTITION_CACHE"
_CACHE_FORMAT = 1


def _iid(num_partitions: int, seed: int = 42) -> tuple[Callable[[int], Partitioner], int]:
    def build(size: int) -> Partitioner:
        from flwr_datasets.partitioner import IidPartitioner

        return IidPartitioner(num_partitions=num_partitions)

    return build, seed


def _dirichlet(
    num_partitions: int, alpha: float = 0.5, min_size: int = 10, seed: int = 42
) -> tuple[Callable[[int], Partitioner], int]:
    if alpha <= 0:
        raise SpecError(f"dirichlet alpha must be > 0, got {alpha}")

    def build(size: int) -> Partitioner:
        from flwr_datasets.partitioner import DirichletPartitioner

        return DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=alpha,
                                    min_partition_size=min_size, self_balancing=False, shuffle=True, seed=seed)

    return build, seed


def _pathological(num_partitions: int, classes: int = 2, seed: int = 42) -> tuple[Callable[[int], Partitioner], int]:
    if classes < 1:
        raise SpecError(f"pathological classes must be >= 1, got {classes}")

    def build(size: int) -> Partitioner:
        # "first-deterministic" guarantees every class is used at least once; the random mode can
        # leave a class to no client at all.
        from flwr_datasets.partitioner import PathologicalPartitioner

        return PathologicalPartitioner(num_partitions=num_partitions, partition_by="label",
                                       num_classes_per_partition=classes,
                                       class_assignment_mode="first-deterministic", shuffle=True, seed=seed)

    return build, seed


def quantity_sizes(num_partitions: int, size: int, beta: float, min_size: int, seed: int) -> list[int]:
    """Partition sizes for quantity skew: proportions q ~ Dir(beta) over the partitions (NIID-Bench,
    Li et al. 2022), drawn again until every partition holds at least ``min_size`` samples (as
    NIID-Bench redraws), rounded so that they add up to ``size``."""
    if num_partitions * min_size > size:
        raise SpecError(f"quantity: {num_partitions} partitions of at least {min_size} need {num_partitions * min_size} "
                        f"samples; the pool has {size}")
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        shares = rng.dirichlet(np.full(num_partitions, beta))
        sizes = np.floor(shares * size).astype(np.int64)
        sizes[np.argmax(shares)] += size - int(sizes.sum())  # the rounding's remainder to the largest
        if sizes.min() >= min_size:
            return [int(v) for v in sizes]
    raise SpecError(f"quantity: beta={beta:g} gave a partition under {min_size} samples in 1,000 draws; "
                    "use a larger beta or min_size=0")


def _quantity(num_partitions: int, beta: float = 0.5, min_size: int = 10,
              seed: int = 42) -> tuple[Callable[[int], Partitioner], int]:
    if beta <= 0 or min_size < 0:
        raise SpecError(f"quantity beta must be > 0 and min_size >= 0, got {beta}, {min_size}")

    def build(size: int) -> Partitioner:
        # the pool is shuffled before it is split (``_draw``): consecutive slices of these sizes
        from flwr_datasets.partitioner import SizePartitioner

        return SizePartitioner(quantity_sizes(num_partitions, size, beta, int(min_size), seed))

    return build, seed


def _natural(num_partitions: int, seed: int = 42) -> tuple[Callable[[int], Partitioner], int]:
    def build(size: int) -> Partitioner:
        return _CheckedNatural(num_partitions)  # type: ignore[return-value]

    return build, seed


class _CheckedNatural:
    """flwr-datasets' ``NaturalIdPartitioner`` (partition i = the i-th smallest id), refusing a run
    whose partition count is not the pool's number of ids (it would leave ids out, or ask for more)."""

    def __init__(self, num_partitions: int) -> None:
        from flwr_datasets.partitioner import NaturalIdPartitioner

        self.num_partitions = num_partitions
        self.inner = NaturalIdPartitioner(partition_by="label")

    @property
    def dataset(self):  # type: ignore[no-untyped-def]
        return self.inner.dataset

    @dataset.setter
    def dataset(self, value) -> None:  # type: ignore[no-untyped-def]
        ids = len(set(value["label"]))
        if ids != self.num_partitions:
            raise SpecError(f"natural partitioning: the pool has {ids} natural ids (the task's groups: roles, "
                            f"writers) and the run {self.num_partitions} partitions; they must be equal")
        self.inner.dataset = value

    def load_partition(self, partition_id: int):  # type: ignore[no-untyped-def]
        return self.inner.load_partition(partition_id)


_REGISTRY = {"iid": _iid, "dirichlet": _dirichlet, "pathological": _pathological, "quantity": _quantity,
             "natural": _natural}


def validate_partitioning(spec: str) -> None:
    """Raise :class:`SpecError` early (in the CLI) for a partitioning spec that cannot work: its
    name, parameters and their values, without importing flwr-datasets (the partitioner is built
    only when a split is drawn)."""
    _make(spec, 2)


def _make(spec: str, num_partitions: int) -> tuple[Callable[[int], Partitioner], int]:
    bound = {name: partial(factory, num_partitions) for name, factory in _REGISTRY.items()}
    return build_from_spec(spec, bound, family="partitioning")


@lru_cache(maxsize=16)
def _all_partitions(labels: tuple[int, ...], spec: str, num_partitions: int,
                    cache_dir: str | None = None) -> tuple[np.ndarray, ...]:
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    digest = hashlib.sha256(f"{_CACHE_FORMAT}|{spec}|{num_partitions}|".encode())
    digest.update(np.asarray(labels, dtype=np.int64).tobytes())
    name, key = f"partitions-{num_partitions}", {"drawing": digest.hexdigest()}
    check = partial(_check_drawing, len(labels), num_partitions)

    def machine() -> dict[str, np.ndarray]:  # the per-machine cache: a later run of this split draws nothing
        return cached_arrays(name, key, lambda: {f"p{i}": part for i, part in enumerate(_draw(labels, spec,
                                                                                              num_partitions))},
                             check, redo="drawing again")

    arrays = cached_arrays(name, key, machine, check, directory=cache_dir, redo="drawing again") if cache_dir \
        else machine()
    return tuple(arrays[f"p{i}"] for i in range(num_partitions))


def _check_drawing(size: int, num_partitions: int, arrays: dict[str, np.ndarray]) -> None:
    """A cached drawing is one int64 array of disjoint in-range indices per partition."""
    if sorted(arrays) != sorted(f"p{i}" for i in range(num_partitions)):
        raise CacheEntryInvalid(f"{len(arrays)} arrays for {num_partitions} partitions")
    seen = np.zeros(size, dtype=bool)
    for part in arrays.values():
        if part.dtype != np.int64 or part.ndim != 1 or (part.size and (part.min() < 0 or part.max() >= size)) \
                or seen[part].any() or np.unique(part).size != part.size:
            raise CacheEntryInvalid(f"indices that are not disjoint ones of {size} samples")
        seen[part] = True


@lru_cache(maxsize=16)  # a process that drew a split (the CLI's preflight) reuses it to fill a cache
def _draw(labels: tuple[int, ...], spec: str, num_partitions: int) -> tuple[np.ndarray, ...]:
    from datasets import ClassLabel, Dataset, Features, Value

    build, seed = _make(spec, num_partitions)
    partitioner = build(len(labels))
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
    labels: Sequence[int] | None, spec: str, num_partitions: int, partition_id: int, size: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> np.ndarray:
    """Indices into the pool (whose class labels are ``labels``) that belong to ``partition_id``.

    A task without class labels (``labels=None``, e.g. regression) has a pool of ``size`` samples
    and can only be split ``iid``: the label-skew partitioners have nothing to skew.
    ``cache_dir`` (default: the ``FEDGE_PARTITION_CACHE`` environment variable) shares the drawing
    between processes (module docstring)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} outside 0..{num_partitions - 1}")
    if labels is None:
        if parse_spec(spec)[0] not in ("iid", "quantity"):
            raise SpecError(f"partitioning {spec!r} skews class labels, and this task has none: use 'iid' or 'quantity', "
                            "or give the task a partition_labels() (e.g. binned targets)")
        if size is None:
            raise ValueError("partition_indices needs the pool size when there are no labels")
        labels = (0,) * size
    directory = os.fspath(cache_dir) if cache_dir else os.environ.get(CACHE_ENV) or None
    return _all_partitions(tuple(int(v) for v in labels), spec, num_partitions, directory)[partition_id]
