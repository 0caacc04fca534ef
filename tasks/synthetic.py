"""A synthetic classification task of any size, for scale tests and benchmarks.

Gaussian class clusters in ``dim`` dimensions classified by an MLP whose hidden width sets the model
size (``hidden=1024, dim=512`` is ~0.5M parameters; ``layers`` adds depth). Generated from a seed, so
every process builds identical data without touching the disk or the network.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from fedge.tasks.base import Task, TensorData

__all__ = ["SyntheticTask"]


@lru_cache(maxsize=4)
def _make_data(
    dim: int, classes: int, samples: int, test_samples: int, noise: float, seed: int
) -> tuple[TensorData, TensorData]:
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=gen)
    total = samples + test_samples
    y = torch.randint(0, classes, (total,), generator=gen)
    x = centers[y] + noise * torch.randn(total, dim, generator=gen)
    return TensorData(x[:samples], y[:samples]), TensorData(x[samples:], y[samples:])


class SyntheticTask(Task):
    """Gaussian clusters + an MLP of configurable width and depth."""

    def __init__(
        self,
        dim: int = 64,
        classes: int = 10,
        hidden: int = 128,
        layers: int = 1,
        samples: int = 4000,
        test_samples: int = 1000,
        noise: float = 2.0,
        seed: int = 0,
    ) -> None:
        if min(dim, classes, hidden, layers, samples, test_samples) < 1:
            raise ValueError("synthetic task sizes must all be >= 1")
        self.dim, self.hidden, self.layers = dim, hidden, layers
        self.num_classes = classes
        self.input_shape = (dim,)
        self._data_args = (dim, classes, samples, test_samples, noise, seed)
        self.spec = (
            f"synthetic:dim={dim},classes={classes},hidden={hidden},layers={layers},"
            f"samples={samples},test_samples={test_samples},noise={noise},seed={seed}"
        )

    def build_model(self) -> nn.Module:
        blocks: list[nn.Module] = []
        width = self.dim
        for _ in range(self.layers):
            blocks += [nn.Linear(width, self.hidden), nn.ReLU()]
            width = self.hidden
        blocks.append(nn.Linear(width, self.num_classes))
        return nn.Sequential(*blocks)

    def train_pool(self) -> TensorData:
        return _make_data(*self._data_args)[0]

    def test_data(self) -> TensorData:
        return _make_data(*self._data_args)[1]
