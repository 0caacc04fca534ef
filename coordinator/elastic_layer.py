"""Elastic averaging (EASGD) as a layer: the one both coordinators run. Fedge's engine's
``algorithm = "easgd"`` is FedAvg with it; a Flower app writes ``layered(FedAvg(...), ElasticAveraging())``
with ``elastic_mod`` on the ClientApp.

The center is the strategy's (or FedAvg's) model and this layer turns its rounds into elastic ones:
every train message names the coupling α (the node, Fedge's FedAvg handler or a Flower app's
``fedge.edge_client.elastic_mod``, trains its own model x_i and sends δ_i = α(x_i − x̃)), every update
weighs the same (the center moves by the differences' sum, not an example-weighted mean), and the
round releases the center's step (β / (α m)) Σ δ_i (``fedge.aggregation.elastic``), from which a
strategy that steps from a mean (FedAvg) moves the center. A reply without a valid
``center-distance`` (‖x_i − x̃‖: the node took no elastic step) is refused. The round's metrics gain
``center_distance``, the mean distance, and, where nodes measured their own models (``local-score``),
their mean under the name ``score``.
"""

from __future__ import annotations

import dataclasses
import math

from fedge.aggregation.elastic import center_step
from fedge.aggregation.exact_sum import ExactScalar
from fedge.aggregation.partial import Partial
from fedge.protocol.config_keys import EASGD_ALPHA
from fedge.protocol.failures import Rejected
from fedge.coordinator.layer import BOUNDED, SUM, Layer
from fedge.protocol.records import CONFIG_RECORD
from fedge.coordinator.step import Outgoing, Step, StepOutcome, Update
from fedge.coordinator.tally import Tally

__all__ = ["ElasticAveraging"]


class ElasticAveraging(Layer):
    """EASGD's server side around a strategy's rounds (see the module docstring); α and β as in
    Fedge's EASGD (defaults 0.3 and 0.9)."""

    key = "easgd"
    needs = frozenset({BOUNDED, SUM})  # after the guard bounded an update, and on the round's whole sum

    def __init__(self, alpha: float = 0.3, beta: float = 0.9, score: str = "client_model_score") -> None:
        if not 0 < alpha <= 1 or not 0 < beta <= 1:
            raise ValueError(f"easgd alpha and beta must be in (0, 1], got {alpha}, {beta}")
        self.alpha, self.beta, self.score = float(alpha), float(beta), score

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        for o in outgoing:  # the coupling, for the node's elastic_mod
            if CONFIG_RECORD in o.content.config_records:
                o.content.config_records[CONFIG_RECORD][EASGD_ALPHA] = self.alpha

    def update(self, step: Step, update: Update) -> Update:
        distance, score = update.metrics.get("center-distance"), update.metrics.get("local-score")
        if not _finite(distance) or distance < 0:
            raise Rejected(f"center-distance must be a finite number >= 0, got {distance!r}")
        if score is not None and not _finite(score):
            raise Rejected(f"local-score must be a finite number, got {score!r}")
        distances, scores = self.scratch(step, lambda: (ExactScalar(), ExactScalar()))  # any arrival order
        distances.add(float(distance))
        if score is not None:
            scores.add(float(score))
        return dataclasses.replace(update, weight=1.0)  # every difference counts once

    def release(self, step: Step, partial: Partial) -> Partial:
        """The center's step, as the mean the strategy steps from."""
        if partial.is_empty:
            return partial
        moved = center_step(partial.sum(), partial.count, self.alpha, self.beta)
        return Partial.of_mean(moved, partial.weight, partial.count, members=partial.members, planned=partial.planned)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        distances, scores = self.scratch(step, lambda: (ExactScalar(), ExactScalar()))
        outcome.extra.update({"alpha": self.alpha, "beta": self.beta})
        if distances.count:
            outcome.extra["center_distance"] = distances.value / distances.count
        if scores.count:  # the nodes' own models, measured on the nodes
            outcome.extra[self.score] = scores.value / scores.count


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
