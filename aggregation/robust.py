"""Aggregation rules for the decoded updates of one step: ``aggregator = mean | median | ...``.

``mean`` is the weighted mean (FedAvg) and streams: one accumulator, O(model) whatever the number of
clients. The robust rules cannot stream: the coordinate-wise median, the trimmed mean and Krum look
at every update of the step together, so they hold them all, ``capacity x numel`` float32 values
(plus Krum's ``capacity x capacity`` distance matrix). :func:`aggregator_memory_bytes` states that
cost before a run starts, so a configuration that would not fit its memory limit is refused up front.

The rules, on updates (model deltas) rather than models: a coordinate-wise median, a trimmed mean
and the Krum distances are all translation invariant, so the result equals the same rule applied
to the client models ``global + delta_i`` minus ``global``.

- ``median``: coordinate-wise median (Yin et al., ICML 2018), unweighted (the middle two averaged
  for an even count, like ``numpy.median`` and Flower's ``FedMedian``).
- ``trimmed-mean:beta=B``: per coordinate, drop the ``floor(B*n)`` largest and smallest values and
  average the rest, unweighted (Yin et al.; Flower's ``FedTrimmedAvg``, default B = 0.2).
- ``krum:f=F``: the one update whose summed squared distance to its ``n - f - 2`` nearest
  neighbours is smallest (Blanchard et al., NeurIPS 2017); needs n >= 2f + 3.
- ``multikrum:f=F,m=M``: the weighted mean of the M lowest-scoring updates (Flower's ``MultiKrum``
  weights them by example count, and so does this).

Every buffered rule takes ``nnm=F``: nearest-neighbour mixing (Allouah et al., "Fixing by Mixing",
AISTATS 2023) before the rule, each update replaced by the unweighted mean of its ``n - F`` nearest
updates (itself included). Why: these rules were built for i.i.d. data. On skewed data honest updates
are far apart, so the trimmed mean's cut removes honest extremes on one side while the attackers sit
on the other (a bias toward the attackers), and Krum applies one client's update, which on skewed
data drags the model toward that client's classes. After mixing, every honest update is close to the
mean of the honest ones (its ``n - F`` neighbours are mostly honest) while each attacker's is diluted
by its honest neighbours; the paper proves that this makes Krum, the median and the trimmed mean
reach the optimal error under heterogeneity. It costs a second ``capacity x numel`` buffer and the
``capacity x capacity`` distance matrix (both counted in :meth:`Aggregator.memory_bytes`).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedge.aggregation.partial import Partial
from fedge.aggregation.streaming_mean import StreamingMean
from fedge.compression.spec import build_from_spec

__all__ = [
    "AGGREGATORS",
    "register_aggregator",
    "Aggregator",
    "Mean",
    "Median",
    "MultiKrum",
    "TrimmedMean",
    "aggregator_memory_bytes",
    "make_aggregator",
    "nearest_neighbour_mixing",
    "pairwise_sq_distances",
    "validate_aggregator",
]


class Aggregator(ABC):
    """Combines the decoded updates of one step into one update."""

    #: a streaming rule holds O(model) whatever the number of updates
    streaming = False

    def __init__(self, numel: int, capacity: int) -> None:
        self.numel, self.capacity = numel, capacity

    @property
    @abstractmethod
    def spec(self) -> str: ...

    @property
    @abstractmethod
    def count(self) -> int:
        """Updates added so far."""

    @abstractmethod
    def add(self, vector: torch.Tensor, weight: float) -> None:
        """Add one decoded update with its (already bounded) aggregation weight."""

    @abstractmethod
    def result(self) -> torch.Tensor:
        """The aggregated update; raises ``ValueError`` if nothing was added."""

    def chosen(self) -> list[int] | None:
        """Positions (in the order of :meth:`add`) of the updates the result is made of, when the
        rule selects some (Krum); ``None`` when every update contributes."""
        return None

    def ready(self, minimum: int) -> bool:
        """Whether the step has enough updates to release a result (``min-replies``)."""
        return self.count >= minimum

    def partial(self) -> Partial:
        """The step's partial aggregate. A robust rule's output is not a sum: it stands as the mean of
        unit weight."""
        if self.count == 0:
            return Partial.empty(self.numel)
        return Partial.of_mean(self.result(), 1.0, self.count)

    @classmethod
    def memory_bytes(cls, numel: int, capacity: int, **params: Any) -> int:
        """Bytes the rule holds for ``capacity`` updates of ``numel`` float32 values."""
        return 4 * numel


class Mean(Aggregator):
    """Weighted mean, streaming (``aggregation.StreamingMean``)."""

    streaming = True

    def __init__(self, numel: int, capacity: int) -> None:
        super().__init__(numel, capacity)
        self._mean = StreamingMean(numel)

    @property
    def spec(self) -> str:
        return "mean"

    @property
    def count(self) -> int:
        return self._mean.count

    def add(self, vector: torch.Tensor, weight: float) -> None:
        self._mean.add(vector, weight)

    def result(self) -> torch.Tensor:
        return self._mean.mean()

    def partial(self) -> Partial:
        return self._mean.partial()

    @classmethod
    def memory_bytes(cls, numel: int, capacity: int, **params: Any) -> int:
        return 12 * numel  # the exact sum's two limbs (aggregation.exact_sum)


def pairwise_sq_distances(rows: torch.Tensor) -> torch.Tensor:
    """``n x n`` float64 squared Euclidean distances between the rows of ``rows``.

    Direct differences, not ``|x|^2 + |y|^2 - 2xy``: no cancellation between near-equal updates
    (and a row at distance 0 from itself exactly)."""
    n = rows.shape[0]
    distances = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        d = ((rows[i + 1 :] - rows[i]) ** 2).sum(dim=1, dtype=torch.float64)
        distances[i, i + 1 :] = d
        distances[i + 1 :, i] = d
    return distances


def nearest_neighbour_mixing(rows: torch.Tensor, f: int) -> torch.Tensor:
    """NNM (Allouah et al., AISTATS 2023): row ``i`` of the result is the unweighted mean of the
    ``max(1, n - f)`` rows nearest to row ``i``, row ``i`` itself always among them (ties broken by
    position). ``f = 0`` turns every row into the mean of all; ``f >= n - 1`` leaves them as they are."""
    n = rows.shape[0]
    keep = max(1, n - f)
    distances = pairwise_sq_distances(rows)
    distances.fill_diagonal_(-1.0)  # itself first, even when another row is identical to it
    nearest = torch.argsort(distances, dim=1, stable=True)[:, :keep]
    mixed = torch.empty_like(rows)
    # Accumulate row by row in one float64 row instead of gathering each neighbourhood
    # (``rows[nearest[i]]`` would copy ``keep x numel`` more floats than ``aggregator_bytes`` states).
    total = torch.empty(rows.shape[1], dtype=torch.float64)
    for i in range(n):
        total.zero_()
        for j in nearest[i].tolist():
            total.add_(rows[j])
        mixed[i].copy_(total.div_(keep))
    return mixed


class _Buffered(Aggregator):
    """Holds every update of the step in one preallocated ``capacity x numel`` float32 matrix."""

    def __init__(self, numel: int, capacity: int, nnm: int = 0) -> None:
        super().__init__(numel, capacity)
        if capacity < 1:
            raise ValueError(f"{type(self).__name__} needs a capacity of at least one update")
        if not 0 <= nnm < max(capacity, 1):
            raise ValueError(f"nnm (updates a neighbourhood leaves out) must be in 0..{capacity - 1} for "
                             f"steps of at most {capacity} updates, got {nnm}")
        self.nnm = nnm
        self._rows = torch.empty(capacity, numel, dtype=torch.float32)
        self._weights: list[float] = []
        self._arrival: list[int] = []  # the position in the order of add() of each held row

    def _suffix(self) -> str:
        return f",nnm={self.nnm}" if self.nnm else ""

    @property
    def count(self) -> int:
        return len(self._weights)

    def add(self, vector: torch.Tensor, weight: float) -> None:
        flat = vector.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"update has {flat.numel()} elements, expected {self.numel}")
        if self.count >= self.capacity:
            raise ValueError(f"{self.spec} holds at most {self.capacity} updates per step")
        if not (np.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a finite positive number, got {weight!r}")
        self._rows[self.count].copy_(flat)
        self._weights.append(float(weight))
        self._arrival.append(len(self._arrival))

    def _stack(self) -> torch.Tensor:
        """The updates the rule sees, in their canonical order (:meth:`_canonical`), as added or
        mixed with their nearest neighbours (``nnm``)."""
        if not self.count:
            raise ValueError("no update was accumulated")
        self._canonical()
        rows = self._rows[: self.count]
        return nearest_neighbour_mixing(rows, self.nnm) if self.nnm else rows

    def _canonical(self) -> None:
        """Put the held updates in an order that depends on their values alone (lexicographic, then
        by weight), in place with one spare row: a trimmed mean's float sums, NNM's neighbourhoods
        and Krum's ties then give the same bits whatever order the replies came in (and a shift of
        every update shifts the result: the order is translation-invariant)."""
        n = self.count
        rows = self._rows

        def compare(i: int, j: int) -> int:
            differ = torch.ne(rows[i], rows[j]).nonzero()
            if differ.numel():
                k = int(differ[0, 0])
                return -1 if rows[i, k] < rows[j, k] else 1
            return (self._weights[i] > self._weights[j]) - (self._weights[i] < self._weights[j])

        order = sorted(range(n), key=functools.cmp_to_key(compare))  # position p takes row order[p]
        if order == list(range(n)):
            return
        spare = torch.empty(self.numel, dtype=torch.float32)
        done = [False] * n
        for start in range(n):
            if done[start] or order[start] == start:
                done[start] = True
                continue
            spare.copy_(self._rows[start])
            p = start
            while order[p] != start:
                self._rows[p].copy_(self._rows[order[p]])
                done[p] = True
                p = order[p]
            self._rows[p].copy_(spare)
            done[p] = True
        self._weights = [self._weights[i] for i in order]
        self._arrival = [self._arrival[i] for i in order]

    @classmethod
    def memory_bytes(cls, numel: int, capacity: int, **params: Any) -> int:
        return 4 * numel * (capacity + 1) + _mixing_bytes(numel, capacity, params)  # + the spare row


def _mixing_bytes(numel: int, capacity: int, params: dict[str, Any]) -> int:
    """NNM's extra: the mixed copy of the buffer, its float64 distance matrix and one float64 row."""
    return 4 * numel * capacity + 8 * capacity * capacity + 8 * numel if int(params.get("nnm", 0) or 0) else 0


class Median(_Buffered):
    @property
    def spec(self) -> str:
        return "median" + (f":nnm={self.nnm}" if self.nnm else "")

    def result(self) -> torch.Tensor:
        # overwrite_input: numpy partitions the buffer in place instead of copying it (the buffer is
        # spent after the step), so the rule costs the buffer and nothing more.
        stacked = self._stack().numpy()
        return torch.from_numpy(np.asarray(np.median(stacked, axis=0, overwrite_input=True), dtype=np.float32))


class TrimmedMean(_Buffered):
    def __init__(self, numel: int, capacity: int, beta: float = 0.2, nnm: int = 0) -> None:
        if not 0.0 <= beta < 0.5:
            raise ValueError(f"trimmed-mean beta must be in [0, 0.5), got {beta}")
        super().__init__(numel, capacity, nnm=nnm)
        self.beta = beta

    @property
    def spec(self) -> str:
        return f"trimmed-mean:beta={self.beta:g}" + self._suffix()

    def result(self) -> torch.Tensor:
        stacked = self._stack().numpy()
        n = stacked.shape[0]
        cut = int(self.beta * n)
        if n - 2 * cut < 1:  # cannot happen for beta < 0.5; kept as a guard for the arithmetic
            raise ValueError(f"trimmed-mean beta={self.beta} leaves no update of {n}")
        stacked.partition((cut, n - cut - 1), axis=0)  # in place, like overwrite_input above
        return torch.from_numpy(np.asarray(stacked[cut : n - cut].mean(axis=0), dtype=np.float32))


class MultiKrum(_Buffered):
    """Krum (``m = 1``) and Multi-Krum selection, then the weighted mean of the chosen updates."""

    def __init__(self, numel: int, capacity: int, f: int = 1, m: int = 1, nnm: int = 0) -> None:
        if f < 0:
            raise ValueError(f"krum f (Byzantine clients tolerated) must be >= 0, got {f}")
        if m < 1:
            raise ValueError(f"multikrum m (updates kept) must be >= 1, got {m}")
        if capacity < 2 * f + 3:
            raise ValueError(f"krum with f={f} needs at least {2 * f + 3} updates per step (n >= 2f + 3), "
                             f"but a step has at most {capacity}")
        if m > capacity:
            raise ValueError(f"multikrum m={m} keeps more updates than a step has ({capacity})")
        super().__init__(numel, capacity, nnm=nnm)
        self.f, self.m = f, m
        self._chosen: list[int] | None = None

    @property
    def spec(self) -> str:
        rule = f"krum:f={self.f}" if self.m == 1 else f"multikrum:f={self.f},m={self.m}"
        return rule + self._suffix()

    def scores(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Each update's summed squared distance to its ``max(1, n - f - 2)`` nearest others
        (the same neighbourhood Flower uses when fewer updates than planned arrive)."""
        rows = self._stack() if rows is None else rows
        n = rows.shape[0]
        distances = pairwise_sq_distances(rows)
        closest = max(1, n - self.f - 2)
        scores = torch.empty(n, dtype=torch.float64)
        for i in range(n):
            others = torch.cat([distances[i, :i], distances[i, i + 1 :]])
            scores[i] = others.sort().values[:closest].sum() if others.numel() else 0.0
        return scores

    def result(self) -> torch.Tensor:
        rows = self._stack()
        order = torch.argsort(self.scores(rows), stable=True)
        chosen = order[: min(self.m, rows.shape[0])].tolist()
        self._chosen = sorted(self._arrival[i] for i in chosen)  # positions in the order of add()
        mean = StreamingMean(self.numel)
        for i in chosen:
            mean.add(rows[i], self._weights[i])
        return mean.mean()

    def chosen(self) -> list[int] | None:
        return self._chosen

    @classmethod
    def memory_bytes(cls, numel: int, capacity: int, **params: Any) -> int:
        return 4 * numel * (capacity + 4) + 8 * capacity * capacity + _mixing_bytes(numel, capacity, params)


def _krum(numel: int, capacity: int, f: int = 1, nnm: int = 0) -> MultiKrum:
    return MultiKrum(numel, capacity, f=f, m=1, nnm=nnm)


def _multikrum(numel: int, capacity: int, f: int = 1, m: int = 2, nnm: int = 0) -> MultiKrum:
    return MultiKrum(numel, capacity, f=f, m=m, nnm=nnm)


AGGREGATORS: dict[str, Callable[..., Aggregator]] = {
    "mean": Mean,
    "median": Median,
    "trimmed-mean": TrimmedMean,
    "krum": _krum,
    "multikrum": _multikrum,
}
_CLASSES: dict[str, type[Aggregator]] = {"mean": Mean, "median": Median, "trimmed-mean": TrimmedMean,
                                         "krum": MultiKrum, "multikrum": MultiKrum}


def register_aggregator(name: str, factory: Callable[..., Aggregator]) -> None:
    """Make a rule available as ``aggregator = "name[:k=v]"``. ``factory(numel, capacity, **params)``
    returns an :class:`Aggregator`; a class also states its memory (:meth:`Aggregator.memory_bytes`,
    checked against ``aggregator-memory-mb`` before a run starts). Fedge's own names are refused."""
    name = name.lower()
    if name in AGGREGATORS and AGGREGATORS[name] is not factory:
        raise ValueError(f"aggregator {name!r} exists already")
    AGGREGATORS[name] = factory
    if isinstance(factory, type) and issubclass(factory, Aggregator):
        _CLASSES[name] = factory


def make_aggregator(spec: str, numel: int, capacity: int) -> Aggregator:
    """A fresh aggregator for one step of at most ``capacity`` updates of ``numel`` values."""
    return build_from_spec(spec, AGGREGATORS, family="aggregator",
                           extra={"numel": numel, "capacity": capacity})


def aggregator_memory_bytes(spec: str, numel: int, capacity: int) -> int:
    """What the rule ``spec`` holds per step, in bytes (the streaming mean: one accumulator)."""
    from fedge.compression.spec import parse_spec

    name, params = parse_spec(spec)
    cls = _CLASSES.get(name)
    if cls is None:
        # unknown: the registry's error; a factory function of a plugin: a held buffer assumed
        return type(make_aggregator(spec, 1, capacity)).memory_bytes(numel, capacity)
    return cls.memory_bytes(numel, capacity, **params)


def validate_aggregator(spec: str, numel: int, capacity: int, limit_bytes: int) -> Aggregator:
    """Build ``spec`` once on a tiny model to check its parameters, then refuse it if one step of
    ``capacity`` updates of ``numel`` values would need more than ``limit_bytes``."""
    probe = make_aggregator(spec, 1, capacity)
    need = aggregator_memory_bytes(spec, numel, capacity)
    if need > limit_bytes:
        raise ValueError(
            f"aggregator {probe.spec} holds every update of a step: {capacity} x {numel} float32 values = "
            f"{need / 2**20:.1f} MiB, over the limit of {limit_bytes / 2**20:.1f} MiB "
            "(raise aggregator-memory-mb, sample fewer clients per step, or use the streaming 'mean')"
        )
    return probe
