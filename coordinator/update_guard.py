"""The update guard, a layer of both coordinators: every decoded update within the run's norm
bound, every claimed example count under the run's cap (``update-norm``, ``weight-cap``).

The "bound" stage of the door: it sees each decoded update first, before any other layer or the
algorithm. The math lives in ``aggregation.update_bounds``; this adds what a coordinator needs
around it: a bound that rejects becomes :class:`Rejected` (logged, counted, the step goes on), every
clipped update and capped weight is named in the step's metrics row, with the reason, so an
operator can see which clients were held back and why, and the previous step's norms and claims
(the references of ``factor=`` bounds) are kept in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from fedge.aggregation.update_bounds import UpdateRejected, make_norm_bound, make_weight_cap
from fedge.coordinator.layer import BOUNDED, Layer
from fedge.coordinator.step import Step, StepOutcome, Update
from fedge.coordinator.tally import Tally
from fedge.protocol.failures import Rejected

__all__ = ["UpdateGuard"]

log = logging.getLogger(__name__)


class UpdateGuard(Layer):
    key = "guard"
    provides = frozenset({BOUNDED})

    def __init__(self, update_norm: str = "none", weight_cap: str = "none", *, private: bool = False,
                 weighted: bool = True) -> None:
        """``update_norm`` and ``weight_cap`` are the run settings' specs (docs/settings: ``clip:max=M``,
        ``reject:max=M``, ``median:factor=F``, ``fixed:max=N``); a Flower app passes them directly to
        run the same guard through ``fedge.flower.layered``. ``private`` (a differentially private
        run): the rows name the clipped and rejected devices but not their updates' norms, nor a
        limit computed from the norms (privacy audit 3, F6: a norm is a noiseless statistic of one
        device's data). ``weighted`` False: every update weighs 1 (the algorithm does not weigh by
        examples), so no claim is capped."""
        self.private, self.weighted = private, weighted
        self.norm = make_norm_bound(update_norm)
        self.cap = make_weight_cap(weight_cap)
        self._clipped: list[dict[str, Any]] = []
        self._capped: list[dict[str, Any]] = []

    def bound(self, step: int, node: int, update: torch.Tensor) -> torch.Tensor:
        """The update within the norm bound; raises :class:`Rejected` in reject mode."""
        try:
            bounded, note = self.norm.apply(update)
        except UpdateRejected as err:
            raise Rejected("update norm exceeds the bound (its value withheld: differential privacy)"
                           if self.private else str(err)) from None
        if note and self.private:
            note = "clipped to the bound (its norm withheld: differential privacy)"
        if note:
            log.warning("round %d: node %d: %s", step, node, note)
            self._clipped.append({"node": node, "reason": note})
        return bounded

    def weight(self, step: int, node: int, claim: float) -> float:
        """The aggregation weight for a client claiming ``claim`` examples."""
        try:
            weight, note = self.cap.weight(claim)
        except ValueError as err:
            raise Rejected(str(err)) from None
        if note:
            log.warning("round %d: node %d: %s", step, node, note)
            self._capped.append({"node": node, "reason": note})
        return weight

    def update(self, step: Step, update: Update) -> Update:
        vector = self.bound(step.number, update.node, update.vector)
        weight = self.weight(step.number, update.node, float(update.metrics["num-examples"])) \
            if self.weighted else 1.0
        return dataclasses.replace(update, vector=vector, weight=weight)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        """This step's interventions in the metrics row; the step's norms and claims become the
        next step's references."""
        limit = self.norm.limit()
        if self.private and self.norm.factor:  # a multiple of the devices' norms: a statistic of their data
            limit = None
        extra: dict[str, Any] = {
            "update_norm_limit": limit,
            "clipped": len(self._clipped), "clipped_nodes": self._clipped,
            "weight_capped": len(self._capped), "weight_capped_nodes": self._capped,
        }
        self.norm.close_step()
        self.cap.close_step()
        self._clipped, self._capped = [], []
        outcome.extra.update(extra)

    def describe(self) -> dict[str, Any]:
        return {"update_norm": self.norm.spec, "weight_cap": self.cap.spec}

    def state_dict(self) -> dict[str, Any]:
        return {"norm": self.norm.state_dict(), "cap": self.cap.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = {} if state is None else state
        if not isinstance(state, dict):
            raise TypeError("update guard state is not a dict")
        self.norm.load_state_dict(state.get("norm") or {})
        self.cap.load_state_dict(state.get("cap") or {})
