"""``model-average`` as a layer: the model a run measures and delivers is a moving average of the
models its steps publish (``fedge.aggregation.model_average``), while the algorithm keeps training
from its latest. Which algorithms may set it (those with a global model) the registry checks
through ``settings_used``.
"""

from __future__ import annotations

from typing import Any

import torch

from fedge.aggregation.model_average import ModelAverage
from fedge.coordinator.layer import Layer
from fedge.coordinator.step import Step, StepOutcome
from fedge.coordinator.tally import Tally

__all__ = ["ModelAverageLayer"]


class ModelAverageLayer(Layer):
    key = "model-average"

    def __init__(self, average: ModelAverage) -> None:
        self.average = average

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        """What is measured is the average of the published models (the algorithm's own model is
        untouched: devices keep training from it)."""
        if outcome.model is not None:
            outcome.model = self.average.update(outcome.model)
            outcome.extra["model_average"] = self.average.spec

    def delivered(self, model: torch.Tensor) -> torch.Tensor:
        """What the run delivers (evaluated, saved, exported): the average, once there is one."""
        averaged = self.average.value()
        return averaged if averaged is not None else model

    def describe(self) -> dict[str, Any]:
        return {"model_average": self.average.spec}

    def state_dict(self) -> dict[str, Any]:
        return self.average.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError("the checkpoint has no model average: the run did not set model-average")
        self.average.load_state_dict(state)
