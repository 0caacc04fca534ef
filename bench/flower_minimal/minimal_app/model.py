"""The CNN of Fedge's default task (``tasks.digits.DigitsCNN`` at width 1), copied so that this app
stands alone: two 3x3 convolutions, one 2x2 max-pool, two linear layers, 38,282 parameters.
``bench/deployment_rounds.py`` checks the parameter count against Fedge's before it runs anything."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
