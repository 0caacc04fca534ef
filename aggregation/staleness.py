"""Staleness weighting for asynchronous aggregation (FedBuff, FedAsync).

An update that started from model version v and arrives when the server is at version t has
staleness τ = t − v. Its contribution is scaled by s(τ) (Xie, Koyejo, Gupta 2019, "Asynchronous
Federated Optimization"; Nguyen et al., AISTATS 2022, "Federated Learning with Buffered Asynchronous
Aggregation", which uses s(τ) = 1/√(1+τ)):

- ``constant``: s(τ) = 1
- ``poly`` (parameter ``a``, default 0.5): s(τ) = (1 + τ)^(−a); a = 0.5 is FedBuff's choice
- ``hinge`` (parameters ``a``, ``b``): s(τ) = 1 for τ ≤ b, else 1 / (a·(τ − b) + 1)

and an update staler than ``max_staleness`` versions is dropped (bounded staleness, as in
stale-synchronous parallel: Ho et al., NeurIPS 2013).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["STALENESS_FUNCTIONS", "Staleness"]

STALENESS_FUNCTIONS = ("constant", "poly", "hinge")


@dataclass(frozen=True)
class Staleness:
    function: str = "poly"
    a: float = 0.5
    b: float = 4.0
    max_staleness: int = 20

    def __post_init__(self) -> None:
        if self.function not in STALENESS_FUNCTIONS:
            raise ValueError(f"unknown staleness function {self.function!r}; "
                             f"available: {', '.join(STALENESS_FUNCTIONS)}")
        if not (math.isfinite(self.a) and self.a >= 0):
            raise ValueError(f"staleness parameter a must be finite and >= 0, got {self.a}")
        if not (math.isfinite(self.b) and self.b >= 0):
            raise ValueError(f"staleness parameter b must be finite and >= 0, got {self.b}")
        if self.max_staleness < 0:
            raise ValueError(f"max-staleness must be >= 0, got {self.max_staleness}")

    @property
    def spec(self) -> str:
        params = {"constant": "", "poly": f",a={self.a:g}", "hinge": f",a={self.a:g},b={self.b:g}"}[self.function]
        return f"staleness={self.function}{params},max-staleness={self.max_staleness}"

    def dropped(self, staleness: int) -> bool:
        """Whether an update this stale is discarded (staleness above the bound)."""
        if staleness < 0:
            raise ValueError(f"staleness cannot be negative, got {staleness}")
        return staleness > self.max_staleness

    def weight(self, staleness: int) -> float:
        """s(τ), in (0, 1]."""
        if staleness < 0:
            raise ValueError(f"staleness cannot be negative, got {staleness}")
        if self.function == "constant":
            return 1.0
        if self.function == "poly":
            return (1.0 + staleness) ** (-self.a)
        return 1.0 if staleness <= self.b else 1.0 / (self.a * (staleness - self.b) + 1.0)
