"""Seeds in every accuracy benchmark: the mean, its 95% interval, and paired differences.

One run of one seed says little: before the coordinator's sums were exact, one seed of the
partial-participation setting ended anywhere between 89.7% and 96.7%, and a different seed still
moves a final accuracy by points. So a benchmark that reports accuracy runs several seeds
(``--seeds``) and reports the mean with a Student-t 95% interval (:func:`interval`); a comparison
of two settings pairs their runs seed by seed and reports the mean difference with its interval
(:func:`paired`). A difference whose interval contains zero is "no measurable difference"
(:func:`verdict`), never a gain or a loss.

Seeds run side by side (:func:`map_runs`): one process per run, one torch thread per process, as
many runs at once as there are cores (``--workers``). A run's result does not depend on what else
the machine does (the coordinator's sums are exact and every random draw comes from the seed), so
parallel seeds give the bits a sequential loop gives; ``tests/test_bench_harness.py`` checks it on a
real simulation. Each simulated run then gets ``client_slots(workers)`` Ray actors, so the runs
share the cores instead of each asking for all of them.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Interval", "client_slots", "default_workers", "interval", "map_runs", "paired", "seeds_row",
           "t_quantile", "verdict"]

T = TypeVar("T")

# Student's t, 97.5th percentile (two-sided 95%), by degrees of freedom 1..30; beyond, the normal's
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def t_quantile(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("an interval needs at least two values")
    return _T975[df - 1] if df <= len(_T975) else 1.960


@dataclass(frozen=True)
class Interval:
    """A mean and the half-width of its 95% interval over ``n`` values (``half`` is NaN for n = 1)."""

    mean: float
    half: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half

    def contains(self, value: float) -> bool:
        return not math.isnan(self.half) and self.low <= value <= self.high

    def text(self, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
        """``96.11 ± 0.28 (95% CI, 5 seeds)``, or ``96.11 (one seed: no interval)``."""
        mean = f"{self.mean * scale:.{digits}f}{unit}"
        if self.n < 2:
            return f"{mean} (one seed: no interval)"
        return f"{mean} ± {self.half * scale:.{digits}f}{unit} (95% CI, {self.n} seeds)"


def interval(values: Sequence[float]) -> Interval:
    """Mean and Student-t 95% interval of ``values`` (independent runs, one per seed)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(mean, math.nan, 1)
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return Interval(mean, t_quantile(n - 1) * math.sqrt(variance / n), n)


def paired(a: Sequence[float], b: Sequence[float]) -> Interval:
    """The mean of ``a[i] - b[i]`` (run i of both settings shares seed i) and its 95% interval."""
    if len(a) != len(b):
        raise ValueError(f"paired runs need one value per seed on both sides, got {len(a)} and {len(b)}")
    return interval([x - y for x, y in zip(a, b, strict=True)])


def verdict(difference: Interval, scale: float = 100.0, unit: str = " points") -> str:
    """How a paired difference may be reported: a gain or a loss only when its interval excludes zero."""
    if difference.n < 2:
        return f"{difference.mean * scale:+.2f}{unit} (one seed: not a comparison)"
    text = f"{difference.mean * scale:+.2f} ± {difference.half * scale:.2f}{unit} (95% CI, {difference.n} paired seeds)"
    if difference.contains(0.0):
        return f"no measurable difference: {text}"
    return f"{'higher' if difference.mean > 0 else 'lower'}: {text}"


def seeds_row(label: str, values: Sequence[float], baseline: Sequence[float] | None = None,
              **extra: Any) -> dict[str, Any]:
    """One JSON row of a seeded benchmark: every seed's value, the interval, and the paired
    difference against ``baseline`` when given."""
    row: dict[str, Any] = {"label": label, "values": list(values), **extra}
    iv = interval(values)
    row.update({"mean": iv.mean, "ci95_half": None if math.isnan(iv.half) else iv.half, "seeds": iv.n})
    if baseline is not None:
        diff = paired(values, baseline)
        row.update({"paired_difference": diff.mean, "paired_ci95_half": None if math.isnan(diff.half) else diff.half,
                    "verdict": verdict(diff)})
    return row


def default_workers() -> int:
    """One run per core: each run's clients train on one thread (``fedge.edge_client.threads``)."""
    return max(1, os.cpu_count() or 1)


def client_slots(workers: int) -> int:
    """The Ray actors (ClientApps at once) one simulated run gets when ``workers`` runs share the
    machine: its share of the cores, at least one (``launch(parallel_clients=...)``)."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def _one_thread() -> None:
    """A worker process's start: torch (imported later, by the job) keeps to one thread, and so do
    the processes the job starts (the launch passes its environment on). SIGTERM unwinds the job like
    Ctrl-C, so a launch stops every process it started (:func:`map_runs` sends it when it stops)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    signal.signal(signal.SIGTERM, _interrupt)


_STOPPING = False  # set in a worker by SIGTERM: the runs it had queued do not start


def _interrupt(signum: int, frame: object) -> None:
    global _STOPPING
    _STOPPING = True
    raise KeyboardInterrupt(f"signal {signum}")


def _guarded(job: Callable[[Any], T], item: Any) -> T:
    """``job(item)`` in a worker, unless the worker has been told to stop."""
    if _STOPPING:
        raise KeyboardInterrupt("stopped before this run began")
    return job(item)


def map_runs(job: Callable[[Any], T], items: Sequence[Any], workers: int = 1) -> list[T]:
    """``[job(item) for item in items]``, up to ``workers`` at once, each in a fresh process
    (``spawn``: no torch or Flower state inherited from this one), results in ``items``' order. An
    item is whatever names one run: a seed, or a (configuration, seed) pair.

    ``job`` must be a module-level function and ``items`` picklable. With ``workers == 1`` the jobs
    run here, one after another, as a plain loop. A job that raises stops the benchmark: its
    exception is raised here, naming the item."""
    if workers <= 1 or len(items) <= 1:
        return [job(item) for item in items]
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(workers, len(items)), mp_context=context, initializer=_one_thread)
    try:
        futures = [(item, pool.submit(_guarded, job, item)) for item in items]
        results = []
        for item, future in futures:
            try:
                results.append(future.result())
            except Exception as err:
                raise RuntimeError(f"run {item!r} failed: {err}") from err
    except BaseException:
        # stopped (a failed run, Ctrl-C, SIGTERM): no queued run starts, and the running ones are
        # told to stop (their launches stop what they started) instead of running to their end
        for process in list(getattr(pool, "_processes", {}).values()):
            if process.is_alive():
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results
