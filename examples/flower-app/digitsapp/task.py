"""digitsapp: model, data and training, as in Flower's quickstart-pytorch."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """A small CNN for 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits (shipped with it: no download), 20% held out for the server, seed 42."""
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None]
    y = data.target.astype(np.int64)
    order = np.random.default_rng(42).permutation(len(y))
    cut = len(y) // 5
    return x[order[cut:]], y[order[cut:]], x[order[:cut]], y[order[:cut]]


def load_data(partition_id: int, num_partitions: int, batch_size: int, alpha: float, seed: int = 0,
              server_round: int = 0) -> DataLoader:
    """This client's share of the training pool, Dirichlet(alpha) over labels (the split drawn from
    ``seed``), shuffled from the seed, the partition and the round: a run is its seed's."""
    x, y, _, _ = _digits()
    partitioner = DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=alpha,
                                       min_partition_size=5, seed=42 + seed)
    partitioner.dataset = Dataset.from_dict({"index": np.arange(len(y)), "label": y})
    rows = np.asarray(partitioner.load_partition(partition_id)["index"])
    shuffle = torch.Generator().manual_seed(hash((seed, partition_id, server_round)) % 2**63)
    return DataLoader(TensorDataset(torch.from_numpy(x[rows]), torch.from_numpy(y[rows])), batch_size=batch_size,
                      shuffle=True, generator=shuffle)


def load_test() -> DataLoader:
    _, _, x, y = _digits()
    return DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=256)


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
