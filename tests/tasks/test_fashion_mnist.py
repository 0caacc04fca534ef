"""Fashion-MNIST: the IDX reader on a file written here, and the real Debian data when installed."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from fedge.tasks import make_task
from fedge.tasks.fashion_mnist import DatasetMissing, available, read_idx


def test_idx_reader_round_trip_and_validation(tmp_path) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "x-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(b"\0\0\x08\x03" + struct.pack(">3I", 2, 3, 4) + images.tobytes()))
    np.testing.assert_array_equal(read_idx(path), images)
    bad = tmp_path / "bad.gz"
    bad.write_bytes(gzip.compress(b"\0\0\x08\x01" + struct.pack(">I", 5) + b"abc"))
    with pytest.raises(ValueError, match="values for shape"):
        read_idx(bad)


def test_missing_data_names_the_package(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDGE_FASHION_MNIST_DIR", str(tmp_path))
    with pytest.raises(DatasetMissing, match="apt-get install dataset-fashion-mnist"):
        make_task("fashion:train_samples=10,seed=99").train_pool()


@pytest.mark.skipif(not available(), reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_shapes_and_model() -> None:
    task = make_task("fashion:train_samples=1000,test_samples=200")
    pool, test = task.train_pool(), task.test_data()
    assert pool.x.shape == (1000, 1, 28, 28) and test.x.shape == (200, 1, 28, 28)
    assert 0.0 <= float(pool.x.min()) and float(pool.x.max()) <= 1.0 and set(pool.y.tolist()) <= set(range(10))
    assert task.build_model()(test.x[:4]).shape == (4, 10)


def test_the_small_model_is_named_in_the_spec_and_builds_without_the_data() -> None:
    """``model=small`` (9,098 parameters, for DP with few devices per round) travels in the task's
    spec, so every process of a run builds the same model; a name that is not a model is refused."""
    import torch

    small, default = make_task("fashion:model=small"), make_task("fashion")
    assert small.spec == "fashion:model=small" and default.spec == "fashion"
    assert sum(p.numel() for p in small.build_model().parameters()) == 9098
    assert sum(p.numel() for p in default.build_model().parameters()) == 105866
    assert small.build_model()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    niid = make_task("fashion:model=simple-cnn")  # NIID-Bench's simple-cnn
    assert niid.spec == "fashion:model=simple-cnn"
    assert sum(p.numel() for p in niid.build_model().parameters()) == 44426
    assert niid.build_model()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(Exception, match="not one of cnn, small"):
        make_task("fashion:model=tiny")
