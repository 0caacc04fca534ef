"""``model-average``: the model a run delivers is an average of its recent global models.

Why: a sampled round moves the global model toward the few devices it sampled; with label-skewed
data and one device in ten per round, the last rounds swing by several points, and whichever round
happens to be last decides the delivered accuracy. Sparse uplinks aggregated with ``sparse-mean``
swing most (a coordinate one device sent moves by its whole value): on Fashion-MNIST at one round
in ten their best rounds were above fp32 FedAvg's final accuracy and their final rounds 6 points
below. Averaging the iterates is the classical cure for that noise (Polyak and Juditsky, SIAM J.
Control Optim. 1992; stochastic weight averaging on the server: Caldarola, Caputo and Ciccone,
"Improving Generalization in Federated Learning by Seeking Flat Minima", ECCV 2022).

The average is the *output* only: devices keep training from the latest global model (the
downlink, the server optimizer and every algorithm's state are unchanged); the engine evaluates,
saves and exports the average. It costs one model-sized vector on the coordinator and nothing on
the wire.

- ``none``: the delivered model is the last global model.
- ``ema:decay=D``: an exponential moving average ``a <- D a + (1 - D) x`` over the published models,
  starting at the first one (so the initial model never enters); D = 0.8 averages about the last
  five rounds.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fedge.compression.spec import parse_setting

__all__ = ["ModelAverage", "parse_model_average"]


class ModelAverage:
    """An exponential moving average of a sequence of flat models, with its checkpointable state."""

    def __init__(self, decay: float = 0.8) -> None:
        if not (math.isfinite(decay) and 0.0 <= decay < 1.0):
            raise ValueError(f"model-average decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._average: torch.Tensor | None = None
        self.count = 0

    @property
    def spec(self) -> str:
        return f"ema:decay={self.decay:g}"

    def update(self, model: torch.Tensor) -> torch.Tensor:
        """Fold one published model in; returns the average (a copy the caller may keep)."""
        flat = model.detach().reshape(-1).to(torch.float32)
        if not bool(torch.isfinite(flat).all()):
            raise ValueError("model-average: the published model has non-finite values")
        if self._average is None:
            self._average = flat.clone()
        elif self._average.numel() != flat.numel():
            raise ValueError(f"model-average: a model of {flat.numel()} values, the average has {self._average.numel()}")
        else:
            self._average.mul_(self.decay).add_(flat, alpha=1.0 - self.decay)
        self.count += 1
        return self._average.clone()

    def value(self) -> torch.Tensor | None:
        """The current average (None before the first model)."""
        return None if self._average is None else self._average.clone()

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "count": self.count,
                "average": None if self._average is None else self._average.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if float(state["decay"]) != self.decay:
            raise ValueError(f"the checkpoint averaged with decay {state['decay']}, this run asks for {self.decay}")
        average = state["average"]
        if average is not None:
            average = torch.as_tensor(average, dtype=torch.float32).reshape(-1)
            if not bool(torch.isfinite(average).all()):
                raise ValueError("the checkpoint's model average has non-finite values")
        self._average = None if average is None else average.clone()
        self.count = int(state["count"])


def parse_model_average(spec: str) -> ModelAverage | None:
    """``none`` -> None; ``ema:decay=D`` -> :class:`ModelAverage`. Raises ``ValueError`` with the reason."""
    return parse_setting(spec, ModelAverage, "ema", "model-average")
