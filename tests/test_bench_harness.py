"""The seeds harness's arithmetic: Student-t intervals, paired differences, and the verdict."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness.seeds import interval, paired, seeds_row, t_quantile, verdict  # noqa: E402


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
