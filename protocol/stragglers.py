"""The ``stragglers`` run setting, read by the coordinator (validation) and the devices (the
slowdown mod): ``none`` or ``fraction=F,slowdown=S``."""

from __future__ import annotations

import math

from fedge.compression.spec import parse_spec

__all__ = ["parse_stragglers"]


def parse_stragglers(spec: str) -> tuple[float, float]:
    """``none`` or ``fraction=F,slowdown=S`` (the grammar of every Fedge spec; the name may be
    omitted) -> (fraction, slowdown)."""
    if not spec or spec.strip().lower() == "none":
        return 0.0, 1.0
    text = spec if ":" in spec else f"stragglers:{spec}"
    _, params = parse_spec(text)
    unknown = set(params) - {"fraction", "slowdown"}
    if unknown:
        raise ValueError(f"stragglers takes fraction= and slowdown=, not {sorted(unknown)}")
    try:
        fraction, slowdown = float(params.get("fraction", 0.25)), float(params.get("slowdown", 5.0))
    except ValueError as err:
        raise ValueError(f"stragglers {spec!r}: {err}") from None
    if not (0.0 <= fraction <= 1.0):
        raise ValueError(f"stragglers fraction must be in [0, 1], got {fraction}")
    if not (math.isfinite(slowdown) and slowdown >= 1.0):
        raise ValueError(f"stragglers slowdown must be >= 1, got {slowdown}")
    return fraction, slowdown
