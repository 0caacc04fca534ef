"""The embedded default task: scikit-learn's handwritten digits (1,797 8x8 images, 10 classes).

The data ships inside the scikit-learn wheel, so the default demo and every test run offline. A
stratified 20% of the images is held out for evaluation (seeded, identical on every process) and
never partitioned to clients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from importlib import metadata

import numpy as np
import torch
from torch import nn

from fedge.tasks.array_cache import CacheEntryInvalid, cached_arrays
from fedge.tasks.base import Task, TensorData

__all__ = ["DigitsCNN", "DigitsTask"]


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, one 2x2 max-pool, two linear layers: 38,282 parameters at width 1.

    ``width`` multiplies every channel and hidden count: width 8 has 2.4M parameters, the
    "1-5M-parameter model" of the edge benchmark, trained on the same offline data.
    """

    def __init__(self, num_classes: int = 10, width: int = 1) -> None:
        super().__init__()
        c1, c2, hidden = 16 * width, 32 * width, 64 * width
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c2 * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


SAMPLES, CLASSES = 1797, 10  # scikit-learn's digits


def _compute_split(test_fraction: float, seed: int) -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0).numpy()  # (N, 1, 8, 8) in [0, 1]
    y = np.asarray(digits.target, dtype=np.int64)
    train_idx, test_idx = train_test_split(
        list(range(len(y))), test_size=test_fraction, stratify=digits.target, random_state=seed
    )
    return {"x_train": x[train_idx], "y_train": y[train_idx], "x_test": x[test_idx], "y_test": y[test_idx]}


def _check_split(test_fraction: float) -> Callable[[dict[str, np.ndarray]], None]:
    def check(arrays: dict[str, np.ndarray]) -> None:
        expected = math.ceil(test_fraction * SAMPLES)  # scikit-learn's rounding of a float test_size
        sizes = {"train": SAMPLES - expected, "test": expected}
        for part, size in sizes.items():
            x, y = arrays.get(f"x_{part}"), arrays.get(f"y_{part}")
            if x is None or y is None:
                raise CacheEntryInvalid(f"no {part} arrays")
            if x.dtype != np.float32 or x.shape != (size, 1, 8, 8) or y.dtype != np.int64 or y.shape != (size,):
                raise CacheEntryInvalid(f"{part}: {x.dtype}{x.shape}, {y.dtype}{y.shape}")
            if not np.isfinite(x).all() or x.min() < 0 or x.max() > 1 or y.min() < 0 or y.max() >= CLASSES:
                raise CacheEntryInvalid(f"{part}: values out of bounds")
            if len(np.unique(y)) != CLASSES:
                raise CacheEntryInvalid(f"{part}: not every class (the split is stratified)")
    return check


@lru_cache(maxsize=4)
def _split(test_fraction: float, seed: int) -> tuple[TensorData, TensorData]:
    # scikit-learn costs 1.5-2 s to import: the split is computed with it once per machine and read
    # back by every later process (fedge.tasks.array_cache), so the ServerApp of a run whose CLI
    # split the data, and every later run, never import it.
    key = {"sklearn": metadata.version("scikit-learn"), "test_fraction": test_fraction, "seed": seed, "format": 1}
    arrays = cached_arrays("digits-split", key, lambda: _compute_split(test_fraction, seed),
                           _check_split(test_fraction))
    pool = TensorData(torch.from_numpy(arrays["x_train"]), torch.from_numpy(arrays["y_train"]))
    test = TensorData(torch.from_numpy(arrays["x_test"]), torch.from_numpy(arrays["y_test"]))
    return pool, test


class DigitsTask(Task):
    """scikit-learn digits with the 2-conv CNN; ``test_fraction`` and ``split_seed`` fix the split."""

    num_classes = 10
    input_shape = (1, 8, 8)

    def __init__(self, test_fraction: float = 0.2, split_seed: int = 42, width: int = 1) -> None:
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        if not 1 <= width <= 64:
            raise ValueError(f"width must be in 1..64, got {width}")
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.width = width
        extras = [f"{k}={v}" for k, v, default in (("test_fraction", test_fraction, 0.2),
                                                    ("split_seed", split_seed, 42), ("width", width, 1))
                  if v != default]
        self.spec = "digits" + (":" + ",".join(extras) if extras else "")

    def build_model(self) -> nn.Module:
        return DigitsCNN(self.num_classes, self.width)

    def train_pool(self) -> TensorData:
        return _split(self.test_fraction, self.split_seed)[0]

    def test_data(self) -> TensorData:
        return _split(self.test_fraction, self.split_seed)[1]
