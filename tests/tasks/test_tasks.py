import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedge.compression import SpecError
from fedge.tasks import evaluate, flatten_state, make_task, numel_of, unflatten_state
from fedge.tasks.partition import partition_indices


def test_digits_split_and_model() -> None:
    task = make_task("digits")
    pool, test = task.train_pool(), task.test_data()
    assert len(pool) + len(test) == 1797 and len(test) == 360
    assert pool.x.shape[1:] == (1, 8, 8) and float(pool.x.max()) <= 1.0
    # held-out split is stratified: every class present in similar proportion
    assert test.y.bincount(minlength=10).min() >= 34
    assert numel_of(task.build_model().state_dict()) == 38_282


@pytest.mark.parametrize("spec", ["iid", "dirichlet:alpha=0.5", "pathological:classes=2", "quantity:beta=0.5"])
def test_partitions_are_disjoint_and_cover_the_pool(spec: str) -> None:
    task = make_task("digits")
    parts = [task.partition(i, 10, spec) for i in range(10)]
    assert sum(len(p) for p in parts) == len(task.train_pool())
    labels = tuple(int(v) for v in task.train_pool().y.tolist())
    indices = np.concatenate([partition_indices(labels, spec, 10, i) for i in range(10)])
    assert len(set(indices.tolist())) == len(indices)


def test_partitioning_is_deterministic_and_skewed() -> None:
    labels = tuple(int(v) for v in make_task("digits").train_pool().y.tolist())
    a = partition_indices(labels, "dirichlet:alpha=0.5", 10, 3)
    b = partition_indices(labels, "dirichlet:alpha=0.5", 10, 3)
    assert np.array_equal(a, b)
    path = make_task("digits").partition(0, 10, "pathological:classes=2")
    assert len(set(path.y.tolist())) <= 2


def test_quantity_skew_draws_sizes_from_a_dirichlet_and_spreads_labels() -> None:
    """NIID-Bench's quantity skew: sizes ~ Dir(beta) (redrawn until each holds min_size), labels as
    in iid; a small beta skews the sizes more than a large one, and the seed decides the draw."""
    from fedge.tasks.partition import quantity_sizes

    labels = tuple(int(v) for v in make_task("digits").train_pool().y.tolist())
    sizes = [len(partition_indices(labels, "quantity:beta=0.5", 10, i)) for i in range(10)]
    assert sum(sizes) == len(labels) and min(sizes) >= 10
    assert sizes == quantity_sizes(10, len(labels), 0.5, 10, 42)
    spread = {beta: np.std(quantity_sizes(10, 10_000, beta, 0, 7)) for beta in (0.1, 100.0)}
    assert spread[0.1] > 5 * spread[100.0]
    assert quantity_sizes(10, 10_000, 0.5, 0, 1) != quantity_sizes(10, 10_000, 0.5, 0, 2)
    big = make_task("digits").partition(int(np.argmax(sizes)), 10, "quantity:beta=0.5")
    assert len(set(big.y.tolist())) == 10  # the largest share holds every label (no label skew)
    with pytest.raises(SpecError, match="need"):
        quantity_sizes(10, 50, 0.5, 10, 0)


def test_bad_partitioning() -> None:
    task = make_task("digits")
    with pytest.raises(SpecError):
        task.partition(0, 10, "zipf")
    with pytest.raises(ValueError):
        task.partition(10, 10, "iid")
    with pytest.raises(SpecError):
        task.partition(0, 10, "dirichlet:alpha=0")
    with pytest.raises(SpecError):
        task.partition(0, 10, "quantity:beta=0")


def test_synthetic_task_scales() -> None:
    task = make_task("synthetic:dim=512,hidden=1024,layers=2")
    n = numel_of(task.build_model().state_dict())
    assert n == 512 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    assert len(task.test_data()) == 1000


def test_flatten_round_trip() -> None:
    model = make_task("digits").build_model()
    state = model.state_dict()
    flat = flatten_state(state)
    back = unflatten_state(flat, state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(ValueError):
        unflatten_state(flat[:-1], state)


def test_evaluate_counts_correct_predictions() -> None:
    task = make_task("digits")
    torch.manual_seed(0)
    model = task.build_model()
    figures = evaluate(model, task.test_data(), task)
    assert set(figures) == {"loss", "accuracy"}
    assert 0.0 <= figures["accuracy"] <= 0.3 and figures["loss"] > 2.0  # an untrained 10-class model is near chance
    test = task.test_data()
    with torch.no_grad():
        logits = model(test.x)
    assert figures["accuracy"] == pytest.approx(float((logits.argmax(1) == test.y).float().mean()))
    assert figures["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, test.y)), rel=1e-5)


def test_a_runs_processes_share_one_partition_drawing_through_the_cache(tmp_path) -> None:
    """The launcher draws once into the run's cache; a node process then reads its indices without
    importing flwr-datasets (~1.8 CPU-s per process), and they are the indices it would draw."""
    labels = make_task("digits").partition_labels(make_task("digits").train_pool())
    drawn = [partition_indices(labels, "dirichlet:alpha=0.5", 4, i) for i in range(4)]
    partition_indices(labels, "dirichlet:alpha=0.5", 4, 0, cache_dir=tmp_path)
    (cached,) = tmp_path.glob("partitions-4-*.npz")
    probe = ("import sys, json; from fedge.tasks import make_task; t = make_task('digits'); "
             "p = t.partition(2, 4, 'dirichlet:alpha=0.5'); "
             "print(json.dumps(['flwr_datasets' in sys.modules, len(p)]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "FEDGE_PARTITION_CACHE": str(tmp_path)})
    imported, size = json.loads(done.stdout)
    assert not imported and size == len(drawn[2])
    # another spec, count or label set is another file: never one run's split for another's
    partition_indices(labels, "iid", 4, 0, cache_dir=tmp_path)
    partition_indices(labels[:-1], "dirichlet:alpha=0.5", 4, 0, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("partitions-*.npz"))) == 3 and cached.exists()


@pytest.mark.parametrize("tamper", ["garbage", "overlap", "repeat", "out-of-range", "missing"])
def test_a_cached_partition_that_is_not_what_it_claims_is_drawn_again(tmp_path, caplog, tamper: str) -> None:
    from fedge.tasks.partition import _all_partitions

    labels = tuple(int(v) for v in make_task("digits").partition_labels(make_task("digits").train_pool()))
    truth = partition_indices(labels, "iid", 3, 1)
    partition_indices(labels, "iid", 3, 1, cache_dir=tmp_path)
    (path,) = tmp_path.glob("partitions-3-*.npz")
    parts = [np.load(path)[f"p{i}"] for i in range(3)]
    if tamper == "garbage":
        path.write_bytes(b"PK\x03\x04 not a zip file")
    elif tamper == "overlap":  # one sample in two partitions
        np.savez(path, p0=parts[0], p1=np.concatenate([parts[1], parts[0][:1]]), p2=parts[2])
    elif tamper == "repeat":  # one sample twice in one partition
        np.savez(path, p0=parts[0], p1=np.concatenate([parts[1], parts[1][:1]]), p2=parts[2])
    elif tamper == "out-of-range":
        np.savez(path, p0=parts[0], p1=np.append(parts[1], len(labels)), p2=parts[2])
    else:
        np.savez(path, p0=parts[0], p1=parts[1])
    _all_partitions.cache_clear()  # a new process: nothing held in memory
    with caplog.at_level("WARNING", logger="fedge.tasks.partition"):
        again = partition_indices(labels, "iid", 3, 1, cache_dir=tmp_path)
    assert np.array_equal(again, truth)
    assert "drawing again" in caplog.text
    assert np.array_equal(np.load(path)["p1"], truth)  # and the cache holds the true drawing again
