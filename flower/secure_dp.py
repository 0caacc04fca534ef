"""Distributed DP for :func:`fedge.flower.secure`: the devices add the noise inside the ring.

With ``differential_privacy="gaussian:noise=z,clip=C,delta=...,budget=..."`` every sampled device
clips its update to L2 norm C, scales and rounds it, and adds Skellam noise before masking
(``fedge.privacy.distributed_dp``, the device code Fedge's own runs use), so the coordinator never
sees a noiseless sum; it only samples, divides and accounts, through the mechanism Fedge's engine
uses (``fedge.privacy.distributed_release``); this module is its adapter:

- Devices are sampled by Poisson sampling at rate q = the wrapped strategy's ``fraction_train``,
  from the OS CSPRNG: what the accountant's amplification assumes (the strategy's own sampler,
  a fixed-size sample, is not used).
- The noisy sum is divided by the expected number of devices q N; every device weighs the same.
- A round whose sum cannot be unmasked (or with fewer than two devices sampled) releases the
  current model plus noise of the same scale drawn here: whether noise appears never depends on
  who answered.
- Each of the k nodes planned into a round adds 1/k of the noise; the coordinator adds the shares
  of those that dropped, so the released sum carries the same noise whoever took part. The ledger
  (Agarwal, Kairouz and Liu 2021's Skellam RDP, amplified by Poisson sampling) records that noise;
  a round that would take epsilon past ``budget`` is not run.
- The coordinator draws the sample and sees who took part, so against it sampling amplifies
  nothing: ``fedge-dp-epsilon-coordinator`` is the worst device's epsilon against the coordinator
  (``fedge.privacy.accountant.CoordinatorLedger``), ``fedge-dp-epsilon`` the amplified one, against
  whoever sees only the released models.

Adaptive clipping is refused (it needs each device's fitted bit in clear).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from fedge.aggregation.partial import Partial
from fedge.privacy.distributed_release import DistributedRelease
from fedge.privacy.dp_spec import parse_differential_privacy
from fedge.protocol.layer import NOISE, SAMPLE, SUM, Layer
from fedge.protocol.secure_layer import noised_release
from fedge.protocol.step import Step, StepOutcome
from fedge.protocol.tally import Tally

__all__ = ["DistributedDP", "parsed"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def parsed(parse: Callable[[str], T | None], text: str, name: str) -> T:
    """``parse(text)``, its error (a ValueError) or a ``none`` named after the argument ``name``."""
    try:
        value = parse(text)
    except ValueError as err:
        raise ValueError(f"{name} {text!r}: {err}") from None
    if value is None:
        raise ValueError(f"{name} {text!r}: a spec is needed here, not 'none'")
    return value


class DistributedDP(DistributedRelease, Layer):
    """The wrapper's DP layer over the one distributed-DP mechanism (``fedge.privacy.distributed_release``,
    which Fedge's engine's DP layer uses too): the Poisson sample at the strategy's rate, the
    release of the unmasked sum over q N, and the metrics' names."""

    key = "dp"
    provides = frozenset({SAMPLE, NOISE})
    needs = frozenset({SUM})  # it noises the sum secure aggregation unmasked

    def __init__(self, spec: str, rate: float, numel: int = 0) -> None:
        super().__init__(parsed(parse_differential_privacy, spec, "differential_privacy"), numel)
        if not 0 < rate <= 1:
            raise ValueError(f"Poisson sampling needs the strategy's fraction_train in (0, 1], got {rate}")
        self.rate = float(rate)
        self._sampler = random.SystemRandom()
        #: the top-up's and the noise-only release's generator, from the OS CSPRNG
        self.rng = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))

    def start(self, params: torch.Tensor) -> None:
        self.numel = self.numel or int(params.numel())

    def sample(self, nodes: list[int]) -> list[int]:
        """Each connected node independently with probability q (the OS CSPRNG)."""
        return [node for node in sorted(nodes) if self._sampler.random() < self.rate]

    def select(self, nodes: list[int], count: int, key: int) -> list[int]:
        return self.sample(nodes)

    def exhausted(self, connected: int) -> bool:
        return self.would_exceed(self.rate)

    def release(self, step: Step, partial: Partial) -> Partial:
        """The devices' noisy sum (plus the top-up for the planned ones that dropped) over q N, or
        noise alone when no sum was unmasked: never a noiseless release."""
        return noised_release(self, partial, self.rate, step.connected, self.rng)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        outcome.extra.update(self.metrics())

    def metrics(self) -> dict[str, float]:
        return {"fedge-dp-epsilon": self.ledger.epsilon(), "fedge-dp-epsilon-coordinator": self.coordinator.worst()[0],
                "fedge-dp-delta": self.spec.delta,
                "fedge-dp-sampling-rate": self.rate, "fedge-dp-noise-multiplier": self.spec.noise}
