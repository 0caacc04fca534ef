"""Tasks as a user writes them, outside the Fedge package: found by import path
(``tests.tasks.user_tasks:SineTask``), never registered. Small enough for unit tests."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Dataset

from fedge.tasks import Task, TensorData
from fedge.tasks.digits import DigitsTask


class ListDataset(Dataset):
    """A map-style dataset that is not :class:`TensorData`: items built one at a time, as a
    dataset on disk would give them."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index].clone(), self.y[index].clone()


class LinearRegressionTask(Task):
    """y = x·w + noise in ``dim`` dimensions; data through a plain ``Dataset``; default MSE/MAE."""

    target_shape = ()

    def __init__(self, dim: int = 5, samples: int = 400, seed: int = 0) -> None:
        self.input_shape = (dim,)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(samples + 100, dim, generator=gen)
        w = torch.randn(dim, generator=gen)
        y = x @ w + 0.1 * torch.randn(samples + 100, generator=gen)
        self._train, self._test = ListDataset(x[:samples], y[:samples]), ListDataset(x[samples:], y[samples:])

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.input_shape[0], 1), nn.Flatten(0))

    def train_pool(self) -> Dataset:
        return self._train

    def test_data(self) -> Dataset:
        return self._test


class SineTask(Task):
    """A sequence model: a GRU predicts the next value of a noisy sine wave from ``window`` values."""

    input_shape = (12,)
    metric = "mae"

    def __init__(self, samples: int = 300, hidden: int = 8, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        phase = 2 * math.pi * torch.rand(samples + 60, 1, generator=gen)
        steps = torch.arange(13, dtype=torch.float32) * 0.4
        wave = torch.sin(phase + steps) + 0.05 * torch.randn(samples + 60, 13, generator=gen)
        self.hidden = hidden
        self._train = TensorData(wave[:samples, :12], wave[:samples, 12])
        self._test = TensorData(wave[samples:, :12], wave[samples:, 12])

    def build_model(self) -> nn.Module:
        return _GRURegressor(self.hidden)

    def train_pool(self) -> TensorData:
        return self._train

    def test_data(self) -> TensorData:
        return self._test


class _GRURegressor(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x.unsqueeze(-1))
        return self.head(out[:, -1]).squeeze(-1)


class DevicesOnlyDigits(DigitsTask):
    """Digits with no central held-out data: the coordinator can only evaluate on the devices."""

    def test_data(self) -> None:
        return None


class NotATask:
    """What a wrong import path might name."""
