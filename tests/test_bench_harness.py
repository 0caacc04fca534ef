"""The seeds harness: Student-t intervals, paired differences, the verdict, and runs side by side."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness.seeds import client_slots, interval, map_runs, paired, seeds_row, t_quantile, verdict  # noqa: E402


def test_the_interval_is_the_student_t_one() -> None:
    iv = interval([0.90, 0.92, 0.94])
    assert iv.mean == pytest.approx(0.92) and iv.n == 3
    assert iv.half == pytest.approx(4.303 * 0.02 / math.sqrt(3))  # t(0.975, 2) x s / sqrt(n)
    assert t_quantile(4) == 2.776 and t_quantile(100) == 1.960
    assert math.isnan(interval([0.9]).half) and "one seed" in interval([0.9]).text()


def test_a_difference_whose_interval_holds_zero_is_no_difference() -> None:
    same = paired([0.95, 0.96, 0.94, 0.97], [0.96, 0.95, 0.95, 0.96])
    assert verdict(same).startswith("no measurable difference")
    lower = paired([0.90, 0.91, 0.92, 0.90], [0.95, 0.95, 0.96, 0.95])
    assert verdict(lower).startswith("lower") and lower.high < 0
    with pytest.raises(ValueError):
        paired([0.9], [0.9, 0.8])
    row = seeds_row("x", [0.90, 0.91, 0.92, 0.90], baseline=[0.95, 0.95, 0.96, 0.95])
    assert row["seeds"] == 4 and row["paired_difference"] == pytest.approx(lower.mean)


def _threads_and_pid(seed: int) -> tuple[int, str, int]:
    import torch

    if seed < 0:
        raise ValueError("a failing run")
    return seed, os.environ.get("OMP_NUM_THREADS", ""), torch.get_num_threads()


def test_runs_side_by_side_keep_their_order_one_thread_each() -> None:
    got = map_runs(_threads_and_pid, [3, 1, 2], workers=2)
    assert [seed for seed, _, _ in got] == [3, 1, 2]
    assert all(omp == "1" and threads == 1 for _, omp, threads in got)  # spawned workers, one thread each
    assert map_runs(lambda seed: seed * 2, [1, 2], workers=1) == [2, 4]  # one worker: a plain loop, here
    with pytest.raises(RuntimeError, match="run -1 failed: a failing run"):
        map_runs(_threads_and_pid, [1, -1], workers=2)
    assert client_slots(10 ** 6) == 1 and client_slots(1) == (os.cpu_count() or 1)
