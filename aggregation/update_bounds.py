"""Bounds on what one client can do to a step: the norm of its update and its aggregation weight.

Both defend the aggregate against a client that sends a well-formed but hostile update, and both
are cheap enough to apply to every reply of every algorithm.

``update-norm`` (:class:`NormBound`): ``none``; ``clip:max=M`` scales an update whose L2 norm exceeds
M down to M; ``reject:max=M`` refuses it. ``factor=F`` bounds relative to the median norm of the
previous step's accepted updates instead of (or, with both given, as well as) an absolute M, so
the bound follows the training as updates shrink.

``weight-cap`` (:class:`WeightCap`): the example count a client claims is its weight in the
weighted mean, and nothing verifies it: one client claiming 10^9 examples would *be* the mean.
``median:factor=F`` caps every claim at F times the median of the previous step's claims (the
median is safe while fewer than half the clients lie); in a step with no previous claims (the
first step of a run) every client gets the same weight. ``fixed:max=N`` caps at N. ``none`` trusts
the claims. A streaming mean cannot wait for the step's own median: each update is added to the
sum as it arrives and then dropped, which is why the reference is the previous step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from fedge.compression.spec import build_from_spec

__all__ = [
    "NORM_BOUNDS",
    "WEIGHT_CAPS",
    "NormBound",
    "UpdateRejected",
    "WeightCap",
    "make_norm_bound",
    "make_weight_cap",
]


class UpdateRejected(ValueError):
    """An update broke the run's norm bound in ``reject`` mode."""


class NormBound:
    """Clip or reject updates whose L2 norm exceeds a bound; ``mode='none'`` passes everything."""

    def __init__(self, mode: str = "none", max: float = 0.0, factor: float = 0.0) -> None:
        if mode not in ("none", "clip", "reject"):
            raise ValueError(f"norm bound mode must be none, clip or reject, got {mode!r}")
        if not (math.isfinite(max) and max >= 0 and math.isfinite(factor) and factor >= 0):
            raise ValueError(f"norm bound max and factor must be finite and >= 0, got max={max}, factor={factor}")
        if mode != "none" and max == 0 and factor == 0:
            raise ValueError(f"update-norm {mode} needs max=M (absolute) or factor=F (times the previous "
                             "step's median norm)")
        self.mode, self.max, self.factor = mode, float(max), float(factor)
        self._reference: float | None = None  # median accepted norm of the previous step
        self._norms: list[float] = []

    @property
    def spec(self) -> str:
        if self.mode == "none":
            return "none"
        params = [f"max={self.max:g}"] if self.max else []
        params += [f"factor={self.factor:g}"] if self.factor else []
        return f"{self.mode}:{','.join(params)}"

    def limit(self) -> float | None:
        """The bound in force for the current step (``None``: unbounded)."""
        if self.mode == "none":
            return None
        limits = [self.max] if self.max else []
        if self.factor and self._reference:
            limits.append(self.factor * self._reference)
        return min(limits) if limits else None

    def apply(self, update: torch.Tensor) -> tuple[torch.Tensor, str | None]:
        """The update to use and, if the bound acted, a note saying how; raises
        :class:`UpdateRejected` in ``reject`` mode."""
        norm = float(update.norm())
        limit = self.limit()
        if limit is None or norm <= limit:
            self._norms.append(norm)
            return update, None
        if self.mode == "reject":
            raise UpdateRejected(f"update norm {norm:.4g} exceeds the bound {limit:.4g} ({self.spec})")
        self._norms.append(limit)
        return update * (limit / norm), f"clipped norm {norm:.4g} to {limit:.4g}"

    def close_step(self) -> None:
        """The accepted norms of this step become the next step's reference."""
        if self._norms:
            self._reference = statistics.median(self._norms)
        self._norms = []

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self._reference}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reference = _positive_or_none(state.get("reference"), "norm reference")


class WeightCap:
    """Caps client-claimed aggregation weights (example counts)."""

    def __init__(self, mode: str = "median", factor: float = 5.0, max: float = 0.0) -> None:
        if mode not in ("none", "median", "fixed"):
            raise ValueError(f"weight cap must be none, median or fixed, got {mode!r}")
        if mode == "median" and not (math.isfinite(factor) and factor >= 1):
            raise ValueError(f"weight-cap median factor must be >= 1, got {factor}")
        if mode == "fixed" and not (math.isfinite(max) and max > 0):
            raise ValueError(f"weight-cap fixed needs max > 0, got {max}")
        self.mode, self.factor, self.max = mode, float(factor), float(max)
        self._reference: float | None = None  # median claim of the previous step
        self._claims: list[float] = []

    @property
    def spec(self) -> str:
        return {"none": "none", "median": f"median:factor={self.factor:g}", "fixed": f"fixed:max={self.max:g}"}[
            self.mode]

    def weight(self, claim: float) -> tuple[float, str | None]:
        """The weight to aggregate with and, if the claim was not taken as is, why."""
        if not (math.isfinite(claim) and claim > 0):
            raise ValueError(f"claimed weight must be a finite positive number, got {claim!r}")
        if self.mode == "none":
            return claim, None
        if self.mode == "fixed":
            return (self.max, f"claimed {claim:g}, capped at {self.max:g}") if claim > self.max else (claim, None)
        self._claims.append(claim)
        if self._reference is None:
            return 1.0, None  # no reference yet: every client weighs the same this step
        cap = self.factor * self._reference
        return (cap, f"claimed {claim:g}, capped at {cap:g} ({self.spec})") if claim > cap else (claim, None)

    def close_step(self) -> None:
        if self._claims:
            self._reference = statistics.median(self._claims)
        self._claims = []

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self._reference}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reference = _positive_or_none(state.get("reference"), "weight reference")


def _positive_or_none(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite positive number or None, got {value!r}")
    return float(value)


def _norm_factory(mode: str) -> Callable[..., NormBound]:
    def build(max: float = 0.0, factor: float = 0.0) -> NormBound:
        return NormBound(mode, max=max, factor=factor)

    return build


def _none_bound() -> NormBound:
    return NormBound("none")


NORM_BOUNDS: dict[str, Callable[..., NormBound]] = {
    "none": _none_bound, "clip": _norm_factory("clip"), "reject": _norm_factory("reject"),
}


def _median_cap(factor: float = 5.0) -> WeightCap:
    return WeightCap("median", factor=factor)


def _fixed_cap(max: float = 0.0) -> WeightCap:
    return WeightCap("fixed", max=max)


def _no_cap() -> WeightCap:
    return WeightCap("none")


WEIGHT_CAPS: dict[str, Callable[..., WeightCap]] = {"none": _no_cap, "median": _median_cap, "fixed": _fixed_cap}


def make_norm_bound(spec: str) -> NormBound:
    """``none``, ``clip:max=M[,factor=F]`` or ``reject:max=M[,factor=F]``."""
    return build_from_spec(spec, NORM_BOUNDS, family="update-norm")


def make_weight_cap(spec: str) -> WeightCap:
    """``median[:factor=5]``, ``fixed:max=N`` or ``none``."""
    return build_from_spec(spec, WEIGHT_CAPS, family="weight-cap")
