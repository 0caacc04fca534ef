"""The embedded default task: scikit-learn's handwritten digits (1,797 8x8 images, 10 classes).

The data ships inside the scikit-learn wheel, so the default demo and every test run offline. A
stratified 20% of the images is held out for evaluation (seeded, identical on every process) and
never partitioned to clients.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

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


@lru_cache(maxsize=4)
def _split(test_fraction: float, seed: int) -> tuple[TensorData, TensorData]:
    # scikit-learn is imported here, not at module level: it costs 1.5-2 s, and a deployed ClientApp
    # (a fresh process per message) that reads its cached partition never needs it.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        list(range(len(y))), test_size=test_fraction, stratify=digits.target, random_state=seed
    )
    pool = TensorData(x[train_idx], y[train_idx])
    test = TensorData(x[test_idx], y[test_idx])
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
