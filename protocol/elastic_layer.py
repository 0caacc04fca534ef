"""Elastic averaging (EASGD) as a layer, for a Flower app: ``layered(FedAvg(...), ElasticAveraging())``
with ``elastic_mod`` on the ClientApp.

Fedge's engine runs EASGD as an algorithm (``algorithm = "easgd"``: the center is its model). In a
user's ServerApp the strategy keeps the model, so the center is the strategy's model and this
layer turns its rounds into elastic ones: every train message names the coupling α (the node's
``fedge.edge_client.elastic_mod`` trains its own model x_i and replies x̃ + δ_i with
δ_i = α(x_i − x̃)), every update weighs the same (the center moves by the differences' sum, not an
example-weighted mean), and the round releases the center's step (β / (α m)) Σ δ_i
(``fedge.aggregation.elastic``, the formulas Fedge's EASGD uses), from which a strategy that steps
from a mean (FedAvg) moves the center. The round's train metrics gain ``center_distance``, the
mean ‖x_i − x̃‖.
"""

from __future__ import annotations

import dataclasses

from fedge.aggregation.elastic import center_step
from fedge.aggregation.partial import Partial
from fedge.protocol.config_keys import EASGD_ALPHA
from fedge.protocol.layer import BOUNDED, SUM, Layer
from fedge.protocol.records import CONFIG_RECORD
from fedge.protocol.step import Outgoing, Step, StepOutcome, Update
from fedge.protocol.tally import Tally

__all__ = ["ElasticAveraging"]


class ElasticAveraging(Layer):
    """EASGD's server side around a strategy's rounds (see the module docstring); α and β as in
    Fedge's EASGD (defaults 0.3 and 0.9)."""

    key = "easgd"
    needs = frozenset({BOUNDED, SUM})  # after the guard bounded an update, and on the round's whole sum

    def __init__(self, alpha: float = 0.3, beta: float = 0.9) -> None:
        if not 0 < alpha <= 1 or not 0 < beta <= 1:
            raise ValueError(f"easgd alpha and beta must be in (0, 1], got {alpha}, {beta}")
        self.alpha, self.beta = float(alpha), float(beta)

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        for o in outgoing:  # the coupling, for the node's elastic_mod
            if CONFIG_RECORD in o.content.config_records:
                o.content.config_records[CONFIG_RECORD][EASGD_ALPHA] = self.alpha

    def update(self, step: Step, update: Update) -> Update:
        distances = self.scratch(step, list)
        distance = update.metrics.get("center-distance")
        if isinstance(distance, (int, float)) and not isinstance(distance, bool):
            distances.append(float(distance))
        return dataclasses.replace(update, weight=1.0)  # every difference counts once

    def release(self, step: Step, partial: Partial) -> Partial:
        """The center's step, as the mean the strategy steps from."""
        if partial.is_empty:
            return partial
        moved = center_step(partial.sum(), partial.count, self.alpha, self.beta)
        return Partial.of_mean(moved, partial.weight, partial.count, members=partial.members, planned=partial.planned)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        distances = self.scratch(step, list)
        outcome.extra.update({"alpha": self.alpha, "beta": self.beta})
        if distances:
            outcome.extra["center_distance"] = sum(distances) / len(distances)
