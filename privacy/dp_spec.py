"""The ``differential-privacy`` run setting: ``none`` or ``gaussian[:noise=1.0,clip=1.0,delta=1e-5,budget=0,adaptive=false]``.

Client-level DP-FedAvg (McMahan, Ramage, Talwar, Zhang, ICLR 2018): each sampled device's update is
clipped to L2 norm ``clip`` (on the device, and again by the coordinator after decoding, so one
device cannot exceed it), the clipped updates are summed, Gaussian noise of standard deviation
``noise x clip`` is added to the sum, and the sum is divided by the expected number of devices.
Devices are sampled by Poisson sampling at rate q = clients-per-round / N, fixed for the run (what the
accountant's amplification assumes): N is ``population`` when declared, else the devices connected
when the first private round samples (``fedge.privacy.sampling.RunRate``). ``delta`` is the delta that epsilon is reported at; ``budget``
is the epsilon at which the run stops (0: never).

``adaptive=true`` (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021, "Differentially Private
Learning with Adaptive Clipping"): ``clip`` is only the first round's bound; each device also says
whether its update fitted under the bound, the coordinator releases a noisy count of those bits
(std m/20 for m expected devices) and moves the bound geometrically toward the ``quantile`` of the
update norms (``clip-lr``: the step). The count's noise is paid for out of the same budget: the
update's noise multiplier becomes (z^-2 - (2 sigma_b)^-2)^-1/2, so the round still costs z.

Beyond one SuperLink (``tier``, set by ``fedge local-cluster --leaves``): the same DP-FedAvg over
every leaf's devices, split by where each part runs. ``tier=leaf`` (a leaf coordinator): Poisson
sampling of the leaf's devices at ``rate`` (the q of the whole federation), each update clipped to
``clip``, and the clipped updates' sum passed up exactly, with no noise; ``tier=root``: the root adds
N(0, (z clip)^2) once to the sum of the leaves' sums, divides by q times the devices connected to the
answering leaves, and accounts at rate q. The leaves see clipped updates; only the root's release
carries noise, and the accountant's guarantee is the flat run's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedge.compression.errors import SpecError
from fedge.compression.spec import parse_setting

__all__ = ["DPSpec", "parse_differential_privacy"]


@dataclass(frozen=True)
class DPSpec:
    noise: float = 1.0
    clip: float = 1.0
    delta: float = 1e-5
    budget: float = 0.0
    adaptive: bool = False
    quantile: float = 0.5
    clip_lr: float = 0.2
    #: beyond one SuperLink: ``leaf`` or ``root`` (empty: one tier), and the federation's sampling rate q
    tier: str = ""
    rate: float = 0.0
    #: the run's declared number of devices (0: those connected at the first private round)
    population: int = 0

    @property
    def spec(self) -> str:
        base = f"gaussian:noise={self.noise:g},clip={self.clip:g},delta={self.delta:g},budget={self.budget:g}"
        base += f",adaptive=true,quantile={self.quantile:g},clip-lr={self.clip_lr:g}" if self.adaptive else ""
        base += f",population={self.population}" if self.population else ""
        return base + (f",tier={self.tier},rate={self.rate:g}" if self.tier else "")


TIERS = ("leaf", "root")


def parse_differential_privacy(spec: str) -> DPSpec | None:
    """``None`` for ``none``; raises :class:`SpecError` naming the bad parameter."""
    result = parse_setting(spec, DPSpec, "gaussian", "differential-privacy")
    if result is None:
        return None
    if result.tier not in ("", *TIERS):
        raise SpecError(f"gaussian: tier={result.tier!r} is not one of {', '.join(TIERS)}")
    if result.population < 0:
        raise SpecError(f"gaussian: population={result.population} is not a number of devices >= 1")
    if not (math.isfinite(result.noise) and result.noise >= 0.1):
        # below 0.1 epsilon runs into the hundreds per round and the PLD accountant's cost explodes
        raise SpecError("gaussian: noise (the noise multiplier z) must be >= 0.1")
    if not (math.isfinite(result.clip) and result.clip > 0):
        raise SpecError("gaussian: clip must be > 0")
    if not 0 < result.delta < 1:
        raise SpecError("gaussian: delta must be in (0, 1)")
    if not (math.isfinite(result.budget) and result.budget >= 0):
        raise SpecError("gaussian: budget must be >= 0 (0: no budget)")
    if not 0 < result.quantile < 1 or not result.clip_lr > 0:
        raise SpecError("gaussian: quantile must be in (0, 1) and clip-lr > 0")
    if result.tier and not 0 < result.rate <= 1:
        raise SpecError(f"gaussian: tier={result.tier} needs the federation's sampling rate, rate in (0, 1]")
    if result.rate and not result.tier:
        raise SpecError("gaussian: rate is the sampling rate of a federation with leaves; it needs tier=leaf or root")
    if result.tier and result.population:
        raise SpecError("gaussian: with leaves the rate is the federation's (rate=Q); population is for one tier")
    if result.tier and result.adaptive:
        raise SpecError("gaussian: adaptive clipping with leaves is not built (the count's noise would be added "
                        "where no noise is); use a fixed clip")
    return result
