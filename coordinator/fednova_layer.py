"""FedNova as a layer: each update divided by its local step norm, the step's mean scaled back by
the effective number of steps (``fedge.aggregation.fednova``; Wang et al., NeurIPS 2020).

The one implementation both coordinators run: Fedge's engine adds it for ``algorithm = "fednova"``
(FedAvg with this layer), and a Flower app wraps its strategy,
``layered(FedAvg(), NormalizedAveraging(momentum=0.9))``, whose ClientApp reports the local steps it
took as the ``local-steps`` metric (Fedge's FedAvg devices always do).

- ``update``: an update of ``n_i`` examples and ``tau_i`` steps enters the weighted mean with
  weight ``n_i / a_i`` (after the update guard has bounded and capped it); the step keeps the exact
  sums of ``n_i`` and ``n_i a_i``. A reply without a valid step count is refused (``invalid``).
- ``release``: the mean ``sum_i (n_i / a_i) d_i / sum_i (n_i / a_i)`` becomes
  ``tau_eff * sum_i p_i d_i / a_i`` with ``p_i = n_i / sum n`` and ``tau_eff = sum_i p_i a_i``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedge.aggregation.exact_sum import ExactScalar
from fedge.aggregation.fednova import FedNovaError, step_norm
from fedge.aggregation.partial import Partial
from fedge.protocol.failures import Rejected
from fedge.coordinator.layer import BOUNDED, Layer
from fedge.coordinator.step import Step, Update

__all__ = ["STEPS_METRIC", "NormalizedAveraging"]

#: the reply metric a device reports its local steps in
STEPS_METRIC = "local-steps"


class NormalizedAveraging(Layer):
    key = "fednova"
    needs = frozenset({BOUNDED})  # the weights it divides are the guard's capped ones

    def __init__(self, momentum: float = 0.0) -> None:
        step_norm(1, momentum)  # FedNovaError (a ValueError) for a momentum outside [0, 1)
        self.momentum = float(momentum)

    def update(self, step: Step, update: Update) -> Update:
        try:
            norm = step_norm(update.metrics.get(STEPS_METRIC, 0), self.momentum)
        except FedNovaError as err:
            raise Rejected(f"fednova: {err} (the reply's {STEPS_METRIC!r})") from None
        weights, norms = self.scratch(step, lambda: (ExactScalar(), ExactScalar()))
        weights.add(update.weight)
        norms.add(update.weight * norm)
        return dataclasses.replace(update, weight=update.weight / norm)

    def release(self, step: Step, partial: Partial) -> Partial:
        sums = step.layers.get(self.key)
        if sums is None or partial.is_empty or not sums[0].count:
            return partial
        total = sums[0].value
        tau_eff = sums[1].value / total
        return partial.replace(average=partial.mean() * (tau_eff * partial.weight / total), total=None)

    def describe(self) -> dict[str, Any]:
        return {"fednova": {"momentum": self.momentum}}
