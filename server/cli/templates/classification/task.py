"""Your task: the model, the data and how to split it, the metrics. Fedge runs the rest.

This template classifies scikit-learn's wine data set (178 samples, 13 features, 3 cultivars; it
ships inside scikit-learn, so nothing is downloaded). To train your own model on your own data,
edit this file only:

* ``build_model``: any ``torch.nn.Module`` whose output is one row of class scores per input;
* ``train_pool``: the samples the simulated devices share out (``partitioning`` in pyproject.toml
  says how: ``iid``, ``dirichlet:alpha=0.5``, ...); any map-style ``torch.utils.data.Dataset`` of
  ``(input, label)`` pairs works, ``TensorData`` is the fast in-memory one;
* ``test_data``: held-out samples for the coordinator; return ``None`` if it has none, and the
  devices evaluate the model on their own held-out part instead (``evaluate = "federated"``);
* ``loss`` and ``metrics`` (optional): defaults are cross-entropy and accuracy for a task with
  ``num_classes``; override them for anything else.

Constructor keywords become task parameters: ``task = "task:WineTask:hidden=64"``.
Fedge's docs/extending.md describes the whole Task API.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from fedge.tasks import Task, TensorData


@lru_cache(maxsize=2)
def _split(seed: int) -> tuple[TensorData, TensorData]:
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split

    x, y = load_wine(return_X_y=True)
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=0.25, stratify=y, random_state=seed)
    mean, std = train_x.mean(axis=0), train_x.std(axis=0) + 1e-8  # statistics of the training part only
    scale = lambda a: torch.tensor((a - mean) / std, dtype=torch.float32)  # noqa: E731
    return (TensorData(scale(train_x), torch.tensor(train_y, dtype=torch.long)),
            TensorData(scale(test_x), torch.tensor(test_y, dtype=torch.long)))


class WineTask(Task):
    num_classes = 3
    input_shape = (13,)

    def __init__(self, hidden: int = 32, seed: int = 0) -> None:
        self.hidden, self.seed = hidden, seed

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(13, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.num_classes))

    def train_pool(self) -> TensorData:
        return _split(self.seed)[0]

    def test_data(self) -> TensorData | None:
        return _split(self.seed)[1]
