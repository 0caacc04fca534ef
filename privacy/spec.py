"""The ``secure-aggregation`` run setting: ``none`` or ``secagg[:bits=8,clip=0.1,weight-cap=512,...]``.

- ``bits``: levels of the shared grid (the ring adds ceil(log2 n) bits to it);
- ``clip``: every coordinate of a device's weighted update is clipped to [-clip, clip];
- ``weight-cap``: the largest example count that still counts in full (a device with w examples
  scales its update by min(w, cap) / cap, see ``shared_grid``);
- ``neighbours``, ``threshold``: the SecAgg+ graph degree and the Shamir threshold (0: defaults);
- ``timeout``: seconds each key-exchange stage waits for replies (dropouts are then recovered);
- ``ratio``: random-k with a support shared by every device of the round: each sends only that
  fraction of the coordinates (masked); the rest waits in its error-feedback residual (1: dense);
- ``issuer``: the operator's CA certificate (``ca.crt`` of ``fedge certs init``). With it the
  coordinator is not trusted: every device's identity must be issued by that CA (bound to its
  node-authentication key, see ``fedge.privacy.credentials``) and devices run the consistency
  round before they unmask. Without it, identities are trusted on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedge.compression.errors import SpecError
from fedge.compression.spec import parse_setting

__all__ = ["SecAggSpec", "parse_secure_aggregation"]


@dataclass(frozen=True)
class SecAggSpec:
    bits: int = 8
    clip: float = 0.1
    weight_cap: int = 512
    neighbours: int = 0
    threshold: int = 0
    timeout: float = 60.0
    ratio: float = 1.0
    issuer: str = ""

    @property
    def spec(self) -> str:
        issuer = f",issuer={self.issuer}" if self.issuer else ""
        return (f"secagg:bits={self.bits},clip={self.clip:g},weight-cap={self.weight_cap},"
                f"neighbours={self.neighbours},threshold={self.threshold},timeout={self.timeout:g},ratio={self.ratio:g}"
                f"{issuer}")


def parse_secure_aggregation(spec: str) -> SecAggSpec | None:
    """``None`` for ``none``; raises :class:`SpecError` naming the bad parameter."""
    result = parse_setting(spec, SecAggSpec, "secagg", "secure-aggregation")
    if result is None:
        return None
    if not 1 <= result.bits <= 16:
        raise SpecError("secagg: bits must be in [1, 16]")
    if not (math.isfinite(result.clip) and result.clip > 0):
        raise SpecError("secagg: clip must be a positive number")
    if result.weight_cap < 1 or result.neighbours < 0 or result.threshold < 0:
        raise SpecError("secagg: weight-cap must be >= 1, neighbours and threshold >= 0")
    if not result.timeout > 0:
        raise SpecError("secagg: timeout must be > 0")
    if not 0 < result.ratio <= 1:
        raise SpecError("secagg: ratio must be in (0, 1]")
    return result
