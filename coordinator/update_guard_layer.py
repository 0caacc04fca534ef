"""The update guard as a layer: every decoded update within the run's norm bound, every claimed
example count under the run's cap (``update-norm``, ``weight-cap``; ``fedge.coordinator.update_guard``).

The "bound" stage of the door: it sees each decoded update first, before any other layer or the
algorithm. It reports its interventions in the step's row and keeps the previous step's norms and
claims (the references of ``factor=`` bounds) in the checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedge.coordinator.layer import BOUNDED, Layer
from fedge.coordinator.step import Step, StepOutcome, Update
from fedge.coordinator.tally import Tally
from fedge.coordinator.update_guard import UpdateGuard

__all__ = ["UpdateGuardLayer"]


class UpdateGuardLayer(Layer):
    key = "guard"
    provides = frozenset({BOUNDED})

    def __init__(self, guard: UpdateGuard, weighted: bool) -> None:
        self.guard = guard
        self.weighted = weighted

    def update(self, step: Step, update: Update) -> Update:
        vector = self.guard.bound(step.number, update.node, update.vector)
        weight = self.guard.weight(step.number, update.node, float(update.metrics["num-examples"])) \
            if self.weighted else 1.0
        return dataclasses.replace(update, vector=vector, weight=weight)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        outcome.extra.update(self.guard.close_step())

    def describe(self) -> dict[str, Any]:
        return {"update_norm": self.guard.norm.spec, "weight_cap": self.guard.cap.spec}

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.guard.load_state_dict(state or {})
