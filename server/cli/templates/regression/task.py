"""Your task: the model, the data and how to split it, the metrics. Fedge runs the rest.

This template is a regression: scikit-learn's diabetes data set (442 patients, 10 features, a
disease-progression score one year later; it ships inside scikit-learn, so nothing is
downloaded). The loss is mean squared error, the metrics MSE and MAE on the standardised target,
and ``metric = "mse"`` (lower is better) drives the progress line, the plot and ``stop-at``.
To train your own model on your own data, edit this file only:

* ``build_model``: any ``torch.nn.Module``; its output has the target's shape (here one number);
* ``train_pool``: the samples the simulated devices share out. A regression has no class labels
  to skew, so ``partitioning = "iid"``, unless ``partition_labels`` returns groups to split by
  (here: quartiles of the target, which makes ``dirichlet:alpha=0.5`` possible);
* ``test_data``: held-out samples for the coordinator; return ``None`` and the devices evaluate
  on their own held-out part instead (``evaluate = "federated"``);
* ``loss`` and ``metrics``: what training minimises and what is reported (each a mean over
  samples, so that devices' figures combine by their example counts).

Constructor keywords become task parameters: ``task = "task:DiabetesTask:hidden=64"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import nn

from fedge.tasks import Task, TensorData


@lru_cache(maxsize=2)
def _split(seed: int) -> tuple[TensorData, TensorData]:
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    x, y = load_diabetes(return_X_y=True)
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=0.2, random_state=seed)
    x_mean, x_std = train_x.mean(axis=0), train_x.std(axis=0) + 1e-8
    y_mean, y_std = train_y.mean(), train_y.std()
    features = lambda a: torch.tensor((a - x_mean) / x_std, dtype=torch.float32)  # noqa: E731
    target = lambda a: torch.tensor((a - y_mean) / y_std, dtype=torch.float32)  # noqa: E731
    return TensorData(features(train_x), target(train_y)), TensorData(features(test_x), target(test_y))


class DiabetesTask(Task):
    input_shape = (10,)
    target_shape = ()  # one number per sample
    metric = "mse"  # lower is better

    def __init__(self, hidden: int = 32, seed: int = 0) -> None:
        self.hidden, self.seed = hidden, seed

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(10, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 1), nn.Flatten(0))

    def train_pool(self) -> TensorData:
        return _split(self.seed)[0]

    def test_data(self) -> TensorData | None:
        return _split(self.seed)[1]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        error = outputs - targets
        return {"mse": float(error.pow(2).mean()), "mae": float(error.abs().mean())}

    def partition_labels(self, pool: TensorData) -> Sequence[int]:
        """Quartiles of the target: lets label-skew partitioners give devices different patients."""
        edges = torch.quantile(pool.y, torch.tensor([0.25, 0.5, 0.75]))
        return torch.bucketize(pool.y, edges).tolist()
