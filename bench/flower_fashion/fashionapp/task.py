"""fashionapp: model, data and training. Not the app the benchmark's codec setting was chosen on:
other images (Fashion-MNIST, 28x28), another model (a LeNet-style CNN), another batch size.

The data is Debian's ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``, or
``$FEDGE_FASHION_MNIST_DIR``), read here: never downloaded. A 12,000-image sample of the training
set is split over the clients; 2,000 test images are the server's held-out set.
"""

from __future__ import annotations

import gzip
import os
import struct
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner
from torch.utils.data import DataLoader, TensorDataset

TRAIN_SAMPLES, TEST_SAMPLES = 12_000, 2_000


class Net(nn.Module):
    """LeNet-style: two 5x5 convolutions (6 and 16 channels), three fully connected layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


def _idx(path: Path) -> np.ndarray:
    """An unsigned-byte IDX file (gzipped or not), checked against its header."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as handle:
        data = handle.read()
    if len(data) < 4 or data[:3] != b"\0\0\x08":
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    shape = struct.unpack(f">{data[3]}I", data[4 : 4 + 4 * data[3]])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * data[3])
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {body.size} values for shape {shape}")
    return body.reshape(shape)


def _file(directory: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (directory / name).exists():
            return directory / name
    raise FileNotFoundError(f"{stem} not in {directory}: apt-get install dataset-fashion-mnist "
                            "(or set FEDGE_FASHION_MNIST_DIR)")


@lru_cache(maxsize=1)
def _fashion() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    directory = Path(os.environ.get("FEDGE_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
    arrays = [_idx(_file(directory, stem)) for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                                        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]
    train = np.random.default_rng(0).permutation(len(arrays[1]))[:TRAIN_SAMPLES]
    test = np.random.default_rng(1).permutation(len(arrays[3]))[:TEST_SAMPLES]
    scale = lambda images: (images.astype(np.float32) / 255.0)[:, None]  # noqa: E731
    return (scale(arrays[0][train]), arrays[1][train].astype(np.int64), scale(arrays[2][test]),
            arrays[3][test].astype(np.int64))


def load_data(partition_id: int, num_partitions: int, batch_size: int, alpha: float, seed: int = 0,
              server_round: int = 0) -> DataLoader:
    """This client's share, Dirichlet(alpha) over labels drawn from ``seed``; shuffled from the seed,
    the partition and the round."""
    x, y, _, _ = _fashion()
    partitioner = DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=alpha,
                                       min_partition_size=10, seed=1000 + seed)
    partitioner.dataset = Dataset.from_dict({"index": np.arange(len(y)), "label": y})
    rows = np.asarray(partitioner.load_partition(partition_id)["index"])
    shuffle = torch.Generator().manual_seed(hash((seed, partition_id, server_round)) % 2**63)
    return DataLoader(TensorDataset(torch.from_numpy(x[rows]), torch.from_numpy(y[rows])), batch_size=batch_size,
                      shuffle=True, generator=shuffle)


def load_test() -> DataLoader:
    _, _, x, y = _fashion()
    return DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=500)


def train(net: Net, loader: DataLoader, epochs: int, lr: float) -> float:
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, steps = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
    return total / max(steps, 1)


def test(net: Net, loader: DataLoader) -> tuple[float, float]:
    net.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = net(x)
            loss += F.cross_entropy(out, y, reduction="sum").item()
            correct += int((out.argmax(1) == y).sum())
            count += len(y)
    return loss / count, correct / count
