"""The ``stragglers`` run setting, read by the coordinator (validation) and the devices (the
slowdown mod): ``none`` or ``fraction=F,slowdown=S[,jitter=J]``, or ``jitter=J`` alone.

``fraction`` and ``slowdown`` make the same devices slow in every run (a benchmark's stragglers);
``jitter`` delays every train reply by a random time in ``[0, J]`` seconds drawn from the operating
system, never from the run's seed: replies then arrive in another order in every run, which is what
a test of "the same seed gives the same run, whatever the order of replies" needs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from fedge.compression.spec import parse_spec

__all__ = ["Stragglers", "parse_stragglers"]


class Stragglers(NamedTuple):
    fraction: float
    slowdown: float
    jitter: float = 0.0


def parse_stragglers(spec: str) -> Stragglers:
    """``none``, ``fraction=F,slowdown=S[,jitter=J]`` or ``jitter=J`` (the grammar of every Fedge
    spec; the name may be omitted). ``jitter`` alone slows no device."""
    if not spec or spec.strip().lower() == "none":
        return Stragglers(0.0, 1.0)
    text = spec if ":" in spec else f"stragglers:{spec}"
    _, params = parse_spec(text)
    unknown = set(params) - {"fraction", "slowdown", "jitter"}
    if unknown:
        raise ValueError(f"stragglers takes fraction=, slowdown= and jitter=, not {sorted(unknown)}")
    only_jitter = set(params) == {"jitter"}
    try:
        fraction = 0.0 if only_jitter else float(params.get("fraction", 0.25))
        slowdown = 1.0 if only_jitter else float(params.get("slowdown", 5.0))
        jitter = float(params.get("jitter", 0.0))
    except ValueError as err:
        raise ValueError(f"stragglers {spec!r}: {err}") from None
    if not (0.0 <= fraction <= 1.0):
        raise ValueError(f"stragglers fraction must be in [0, 1], got {fraction}")
    if not (math.isfinite(slowdown) and slowdown >= 1.0):
        raise ValueError(f"stragglers slowdown must be >= 1, got {slowdown}")
    if not (math.isfinite(jitter) and 0.0 <= jitter <= 60.0):
        raise ValueError(f"stragglers jitter must be in [0, 60] seconds, got {jitter}")
    return Stragglers(fraction, slowdown, jitter)
