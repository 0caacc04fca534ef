"""The per-run guard every algorithm passes decoded updates through: norm bound and weight cap.

The math lives in ``aggregation.update_bounds``; this adds what a coordinator needs around it: a
bound that rejects becomes the engine's :class:`Rejected` (logged, counted, the step goes on), and
every clipped update and capped weight is named in the step's metrics row, with the reason, so an
operator can see which clients were held back and why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fedge.aggregation.update_bounds import UpdateRejected, make_norm_bound, make_weight_cap
from fedge.protocol.failures import Rejected

__all__ = ["UpdateGuard"]

log = logging.getLogger(__name__)


class UpdateGuard:
    def __init__(self, update_norm: str = "none", weight_cap: str = "none", *, private: bool = False) -> None:
        """``update_norm`` and ``weight_cap`` are the run settings' specs (docs/settings: ``clip:max=M``,
        ``reject:max=M``, ``median:factor=F``, ``fixed:max=N``); a Flower app passes them directly to
        run the same guard through ``fedge.flower.layered``. ``private`` (a differentially private
        run): the rows name the clipped and rejected devices but not their updates' norms, nor a
        limit computed from the norms (privacy audit 3, F6: a norm is a noiseless statistic of one
        device's data)."""
        self.private = private
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

    def close_step(self) -> dict[str, Any]:
        """This step's interventions for the metrics row; the step's norms and claims become the
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
        return extra

    def state_dict(self) -> dict[str, Any]:
        return {"norm": self.norm.state_dict(), "cap": self.cap.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError("update guard state is not a dict")
        self.norm.load_state_dict(state.get("norm") or {})
        self.cap.load_state_dict(state.get("cap") or {})
