"""The ``stragglers`` run setting, read by the coordinator (validation) and the devices (the
slowdown mod): ``none`` or ``fraction=F,slowdown=S[,jitter=J]``, or ``jitter=J`` alone.

``fraction`` and ``slowdown`` make the same devices slow in every run (a benchmark's stragglers);
``jitter`` delays every train reply by a random time in ``[0, J]`` seconds drawn from the operating
system, never from the run's seed: replies then arrive in another order in every run, which is what
a test of "the same seed gives the same run, whatever the order of replies" needs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fedge.compression.spec import named_spec, parse_setting, parse_spec

__all__ = ["Stragglers", "parse_stragglers"]


@dataclass(frozen=True)
class Stragglers:
    fraction: float = 0.25
    slowdown: float = 5.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.fraction <= 1.0):
            raise ValueError(f"stragglers fraction must be in [0, 1], got {self.fraction}")
        if not (math.isfinite(self.slowdown) and self.slowdown >= 1.0):
            raise ValueError(f"stragglers slowdown must be >= 1, got {self.slowdown}")
        if not (math.isfinite(self.jitter) and 0.0 <= self.jitter <= 60.0):
            raise ValueError(f"stragglers jitter must be in [0, 60] seconds, got {self.jitter}")


def parse_stragglers(spec: str) -> Stragglers:
    """``none``, ``fraction=F,slowdown=S[,jitter=J]`` or ``jitter=J`` (the grammar of every Fedge
    spec; the name may be omitted). ``jitter`` alone slows no device."""
    parsed = parse_setting(spec, Stragglers, "stragglers", "stragglers", name_optional=True)
    if parsed is None:
        return Stragglers(0.0, 1.0)
    if set(parse_spec(named_spec(spec, "stragglers"))[1]) == {"jitter"}:
        return dataclasses.replace(parsed, fraction=0.0, slowdown=1.0)
    return parsed
