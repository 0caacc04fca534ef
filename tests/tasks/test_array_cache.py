"""The per-machine array cache: computed once, read back checked, recomputed when damaged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedge.tasks.array_cache import CacheEntryInvalid, cached_arrays
from fedge.tasks.digits import _check_split, _compute_split

KEY = {"what": "test", "version": 1}


def _check(arrays: dict[str, np.ndarray]) -> None:
    if arrays.get("a") is None or arrays["a"].shape != (3,) or not np.isfinite(arrays["a"]).all():
        raise CacheEntryInvalid("bad a")


@pytest.fixture(autouse=True)
def _cache_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FEDGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_an_entry_is_computed_once_and_read_back(_cache_here: Path) -> None:
    calls = []

    def compute() -> dict[str, np.ndarray]:
        calls.append(1)
        return {"a": np.arange(3, dtype=np.float32)}

    first = cached_arrays("t", KEY, compute, _check)
    second = cached_arrays("t", KEY, compute, _check)
    assert len(calls) == 1 and np.array_equal(first["a"], second["a"]) and second["a"].dtype == np.float32
    assert cached_arrays("t", {**KEY, "version": 2}, compute, _check) and len(calls) == 2  # another key


@pytest.mark.parametrize("damage", ["truncated", "wrong shape", "not finite", "pickled"])
def test_a_damaged_entry_is_recomputed_and_replaced(_cache_here: Path, damage: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    good = {"a": np.arange(3, dtype=np.float32)}
    cached_arrays("t", KEY, lambda: good, _check)
    (path,) = _cache_here.glob("t-*.npz")
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:40])
    elif damage == "wrong shape":
        np.savez(path, a=np.zeros(4, dtype=np.float32))
    elif damage == "not finite":
        np.savez(path, a=np.array([0, np.nan, 1], dtype=np.float32))
    else:
        np.savez(path, a=np.array([{"x": 1}, 2, 3], dtype=object))
    again = cached_arrays("t", KEY, lambda: good, _check)
    assert np.array_equal(again["a"], good["a"]) and "recomputing" in caplog.text
    assert np.array_equal(np.load(path)["a"], good["a"])  # the entry is whole again


def test_an_unwritable_cache_leaves_the_computation_as_it_was(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FEDGE_CACHE_DIR", str(blocker / "cache"))
    assert np.array_equal(cached_arrays("t", KEY, lambda: {"a": np.ones(3)}, _check)["a"], np.ones(3))


def test_a_computation_that_breaks_its_own_check_is_an_error() -> None:
    with pytest.raises(CacheEntryInvalid):
        cached_arrays("t", KEY, lambda: {"a": np.ones(5)}, _check)


def test_the_digits_split_read_back_is_scikit_learns_and_needs_no_scikit_learn(_cache_here: Path) -> None:
    computed = _compute_split(0.2, 42)
    _check_split(0.2)(computed)
    code = ("import sys, hashlib\nfrom fedge.tasks.digits import _split\npool, test = _split(0.2, 42)\n"
            "print('sklearn' in sys.modules, hashlib.sha256(pool.x.numpy().tobytes() + pool.y.numpy().tobytes()"
            " + test.x.numpy().tobytes() + test.y.numpy().tobytes()).hexdigest())")
    env = {**os.environ, "FEDGE_CACHE_DIR": str(_cache_here)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                           check=True).stdout.split() for _ in range(2)]
    import hashlib

    expected = hashlib.sha256(b"".join(computed[k].tobytes() for k in ("x_train", "y_train", "x_test", "y_test")))
    assert runs[0] == ["True", expected.hexdigest()]  # the first process computes it with scikit-learn
    assert runs[1] == ["False", expected.hexdigest()]  # a later one reads it back, bit for bit, without


def test_a_second_preflight_reads_the_split_back_without_flwr_datasets(_cache_here: Path) -> None:
    """The CLI's preflight draws the demo's split once per machine: a later run's preflight reads
    the same indices from the per-machine cache and never imports flwr-datasets (seaborn, scipy)."""
    code = ("import sys, hashlib\nfrom fedge.server.preflight import preflight\nfrom fedge.server.settings import "
            "RunSettings\nfrom fedge.tasks import make_task\npreflight(RunSettings(partitioning='dirichlet:alpha=0.5'), "
            "num_partitions=10)\nimported = 'flwr_datasets' in sys.modules\ntask = make_task('digits')\n"
            "part = task.partition(3, 10, 'dirichlet:alpha=0.5')\nprint(imported, len(part))")
    env = {**os.environ, "FEDGE_CACHE_DIR": str(_cache_here)}
    env.pop("FEDGE_PARTITION_CACHE", None)
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180,
                           check=True).stdout.split() for _ in range(2)]
    assert runs[0][0] == "True" and runs[1][0] == "False", runs  # drawn once, then read back
    assert runs[0][1] == runs[1][1]  # the same partition
