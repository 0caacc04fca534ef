"""Normalized averaging: ``algorithm = "fednova"``.

FedAvg whose devices may take different numbers of local steps (more data, more epochs, a faster
device) without pulling the model toward their own objective: each update is divided by its step
norm ``a_i`` (``fedge.aggregation.fednova``, from the local steps the device reports and the run's
``momentum``), the normalised updates are averaged with the example weights ``p_i``, and the model
moves by ``tau_eff = sum_i p_i a_i`` times that average (Wang et al., NeurIPS 2020). Devices run
FedAvg's handler unchanged (every FedAvg reply carries ``local-steps``); the codecs, error feedback,
the downlink and the server optimizers work as for FedAvg.

The normalisation is the coordinator's, per update, so it needs each update on its own: FedNova
takes the weighted mean (``aggregator = "mean"``) and no layer that releases only a sum (secure
aggregation, differential privacy); those are refused when the run is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from fedge.aggregation.exact_sum import ExactScalar
from fedge.aggregation.fednova import FedNovaError, step_norm
from fedge.server.algorithms.fedavg import FedAvg, FedAvgStep
from fedge.server.engine.algorithm import Rejected, RunContext, Step, StepOutcome, Update

__all__ = ["FedNova", "STEPS_METRIC"]

#: the reply metric a FedAvg device reports its local steps in
STEPS_METRIC = "local-steps"


@dataclass
class FedNovaStep(FedAvgStep):
    #: sum_i n_i and sum_i n_i a_i over the used updates (exact: the same in any reply order)
    weight_sum: ExactScalar = field(default_factory=ExactScalar)
    norm_sum: ExactScalar = field(default_factory=ExactScalar)


class FedNova(FedAvg):
    name = "fednova"
    device_handler = "fedavg"  # the devices do FedAvg's work and report their steps
    settings_used = frozenset({"server-opt", "aggregator", "downlink-codec", "model-average"})

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        s = ctx.settings
        refused = [f"{key}={value!r}" for key, value, default in (
            ("aggregator", s.aggregator, "mean"), ("secure-aggregation", s.secure_aggregation, "none"),
            ("differential-privacy", s.differential_privacy, "none")) if value != default]
        if refused:
            raise ValueError(f"fednova normalises each update by its own local steps, so it needs every update "
                             f"on its own and their weighted mean: {', '.join(refused)} is not possible with it")
        step_norm(1, s.momentum)  # the run's momentum, checked once

    @property
    def spec(self) -> str:
        return "fednova"

    def open_step(self, number: int, nodes: list[int]) -> FedNovaStep:
        base = super().open_step(number, nodes)
        return FedNovaStep(base.number, base.nodes, aggregate=base.aggregate)

    def absorb(self, step: Step, update: Update) -> None:
        """The update enters the mean with weight ``n_i / a_i``: the mean of the normalised updates is
        then recovered at the close from the two exact sums (``n_i`` and ``n_i a_i``)."""
        assert isinstance(step, FedNovaStep)
        try:
            norm = step_norm(update.metrics.get(STEPS_METRIC, 0), self.ctx.settings.momentum)
        except FedNovaError as err:
            raise Rejected(f"fednova: {err} (the reply's {STEPS_METRIC!r})") from None
        super().absorb(step, Update(update.node, update.vector, update.weight / norm, update.metrics,
                                    update.payload, update.content, update.started))
        step.weight_sum.add(update.weight)
        step.norm_sum.add(update.weight * norm)

    def close(self, step: Step) -> StepOutcome:
        """``x + tau_eff * sum_i p_i d_i / a_i``: the aggregator's mean with weights ``n_i / a_i`` times
        their sum is ``sum_i n_i d_i / a_i``; over ``sum_i n_i`` that is the normalised average, and
        ``tau_eff = sum_i n_i a_i / sum_i n_i``."""
        assert isinstance(step, FedNovaStep)
        released = step.aggregated() if step.weight_sum.count else None
        if released is not None and not released.is_empty:
            total = step.weight_sum.value
            scale = (step.norm_sum.value / total) * released.weight / total  # tau_eff * sum(w) / sum(n)
            step.released = released.replace(average=released.mean() * scale, total=None)
        return super().close(step)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "algorithm": self.spec, "momentum": self.ctx.settings.momentum}
