"""A node's data: the own-data ``.npz`` format is checked before use; cached partitions equal fresh ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from fedge.edge_client.node_data import DataFileError, load_npz, node_data, save_npz
from fedge.edge_client.threads import threads_mod, threads_of
from fedge.tasks import make_task

TASK = make_task("digits")


def _write(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def _good(n: int = 12) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.random((n, 1, 8, 8), dtype=np.float32), "y": rng.integers(0, 10, n)}


def test_a_valid_file_loads_as_float32_and_int64(tmp_path: Path) -> None:
    data = load_npz(_write(tmp_path / "d.npz", **_good()), TASK)
    assert len(data) == 12 and data.x.dtype == torch.float32 and data.y.dtype == torch.int64
    assert data.x.shape == (12, 1, 8, 8)


@pytest.mark.parametrize(
    ("arrays", "words"),
    [
        ({"x": np.zeros((4, 8, 8), np.float32), "y": np.zeros(4, np.int64)}, "needs (N, 1, 8, 8)"),
        ({"x": np.zeros((4, 1, 8, 8), np.int64), "y": np.zeros(4, np.int64)}, "must hold floats"),
        ({"x": np.zeros((4, 1, 8, 8), np.float32), "y": np.zeros(4, np.float32)}, "integer labels"),
        ({"x": np.zeros((4, 1, 8, 8), np.float32), "y": np.full(4, 10)}, "labels must be in 0..9"),
        ({"x": np.zeros((4, 1, 8, 8), np.float32), "y": np.full(4, -1)}, "labels must be in 0..9"),
        ({"x": np.zeros((4, 1, 8, 8), np.float32), "y": np.zeros(3, np.int64)}, "4 samples in x but y has shape (3,)"),
        ({"x": np.zeros((0, 1, 8, 8), np.float32), "y": np.zeros(0, np.int64)}, "no samples"),
        ({"x": np.full((2, 1, 8, 8), np.nan, np.float32), "y": np.zeros(2, np.int64)}, "NaN or infinite"),
        ({"x": np.zeros((2, 1, 8, 8), np.float32), "y": np.zeros((2, 1), np.int64)}, "shape (N,)"),
        ({"x": np.zeros((2, 1, 8, 8), np.float32)}, "exactly the arrays 'x' and 'y'"),
        ({**_good(), "extra": np.zeros(1)}, "exactly the arrays 'x' and 'y'"),
    ],
)
def test_bad_files_are_named_errors(tmp_path: Path, arrays: dict, words: str) -> None:
    with pytest.raises(DataFileError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_npz(_write(tmp_path / "bad.npz", **arrays), TASK)


def test_unreadable_files_and_pickles_are_refused(tmp_path: Path) -> None:
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataFileError, match="not a readable"):
        load_npz(tmp_path / "junk.npz", TASK)
    with pytest.raises(DataFileError, match="not a readable"):
        load_npz(tmp_path / "missing.npz", TASK)
    np.savez(tmp_path / "pickled.npz", x=np.array([{"a": 1}], dtype=object), y=np.zeros(1, np.int64))
    with pytest.raises(DataFileError):
        load_npz(tmp_path / "pickled.npz", TASK)


def test_cached_partition_equals_the_fresh_one_and_is_reused(tmp_path: Path) -> None:
    config = {"partition-id": 1, "num-partitions": 3, "cache-dir": str(tmp_path)}
    fresh = TASK.partition(1, 3, "dirichlet:alpha=0.5")
    first = node_data(config, TASK, "dirichlet:alpha=0.5")
    (cached,) = tmp_path.glob("partition-1-of-3-*.npz")
    again = node_data(config, TASK, "dirichlet:alpha=0.5")
    for data in (first, again):
        assert torch.equal(data.x, fresh.x) and torch.equal(data.y, fresh.y)
    cached.write_bytes(b"truncated")  # a corrupt cache entry is rebuilt, not trusted
    rebuilt = node_data(config, TASK, "dirichlet:alpha=0.5")
    assert torch.equal(rebuilt.y, fresh.y) and load_npz(cached, TASK).x.shape == fresh.x.shape
    assert len(list(tmp_path.glob("partition-*"))) == 1


def test_own_data_wins_over_partitions(tmp_path: Path) -> None:
    path = tmp_path / "own.npz"
    save_npz(path, load_npz(_write(tmp_path / "src.npz", **_good(5)), TASK))
    data = node_data({"data": str(path), "partition-id": 0, "num-partitions": 2}, TASK, "iid")
    assert len(data) == 5
    with pytest.raises(ValueError, match="data=PATH.npz"):
        node_data({}, TASK, "iid")


def test_threads_mod_sets_torch_threads() -> None:
    context = Context(run_id=1, node_id=1, state=RecordDict(), run_config={}, node_config={"threads": 1})
    before = torch.get_num_threads()
    try:
        seen = threads_mod(None, context, lambda m, c: torch.get_num_threads())  # type: ignore[arg-type]
        assert seen == 1
    finally:
        torch.set_num_threads(before)
    for bad in (0, -2, "many"):
        with pytest.raises(ValueError, match="positive integer"):
            threads_of(Context(run_id=1, node_id=1, state=RecordDict(), run_config={}, node_config={"threads": bad}))


def test_node_state_survives_a_device_restart_bit_for_bit(tmp_path: Path) -> None:
    from fedge.edge_client.node_store import NodeStore
    from fedge.edge_client.persistent_state import load_state, save_state

    run_config = {"task": "digits", "algorithm": "fedavg", "codec": "qsgd:bits=4"}
    before = Context(run_id=1, node_id=1, state=RecordDict(), run_config=run_config, node_config={})
    store = NodeStore(before.state, "fedavg")
    residual = torch.randn(1000)
    store.put_tensor("memory", residual)
    store.put_meta("memory-info", {"round": 3, "codec": "qsgd:bits=4"})
    save_state(before, tmp_path / "node-state.npz")
    after = Context(run_id=2, node_id=1, state=RecordDict(), run_config=run_config, node_config={})
    assert load_state(after, tmp_path / "node-state.npz")
    restored = NodeStore(after.state, "fedavg")
    assert torch.equal(restored.get_tensor("memory"), residual)
    assert restored.get_meta("memory-info") == {"round": 3, "codec": "qsgd:bits=4"}
    other = Context(run_id=3, node_id=1, state=RecordDict(), run_config={**run_config, "codec": "fp16"}, node_config={})
    assert not load_state(other, tmp_path / "node-state.npz") and not NodeStore(other.state, "fedavg").keys()
    (tmp_path / "node-state.npz").write_bytes(b"garbage")
    assert not load_state(after, tmp_path / "node-state.npz")
