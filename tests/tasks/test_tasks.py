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


@pytest.mark.parametrize("spec", ["iid", "dirichlet:alpha=0.5", "pathological:classes=2"])
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


def test_bad_partitioning() -> None:
    task = make_task("digits")
    with pytest.raises(SpecError):
        task.partition(0, 10, "zipf")
    with pytest.raises(ValueError):
        task.partition(10, 10, "iid")
    with pytest.raises(SpecError):
        task.partition(0, 10, "dirichlet:alpha=0")


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
