"""Differential privacy as one layer, whatever the mechanism (``differential-privacy = "gaussian:..."``).

The layer is where DP meets a step: the step's sample (Poisson at the accounted rate, from the OS
CSPRNG; no step past the budget), the clipping bound each message carries (``dp-clip``), every
decoded update bounded and weighed 1 (after the update guard: it ``needs`` ``BOUNDED``), the
released :class:`~fedge.aggregation.partial.Partial` noised (after secure aggregation unmasked it:
``SUM``), the ledger's figures in the row and no training loss there (a noiseless aggregate of the
devices' data). What each means is the mechanism's (``fedge.coordinator.dp_mechanisms``): central
Gaussian (adaptive clipping too), a leaf's clip-and-sum and its root's noise, or Skellam noise the
devices add inside secure aggregation's ring. Every step releases, with or without updates, so who
took part never decides whether noise is added. Both coordinators run this class: the engine builds
it from its settings, a Flower app hands ``DifferentialPrivacyLayer.central(...)`` to
``fedge.flower.layered``, and ``fedge.flower.secure(..., differential_privacy=...)`` builds the
distributed one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np

from fedge.aggregation.partial import Partial
from fedge.coordinator.dp_mechanisms import Mechanism, Skellam, central_mechanism
from fedge.coordinator.layer import BOUNDED, NOISE, SAMPLE, SUM, Layer
from fedge.coordinator.step import Outgoing, Step, StepOutcome, Update
from fedge.coordinator.tally import Tally
from fedge.privacy.dp_spec import DPSpec, parse_differential_privacy
from fedge.protocol.config_keys import DP_CLIP
from fedge.protocol.records import CONFIG_RECORD

__all__ = ["DifferentialPrivacyLayer"]


class DifferentialPrivacyLayer(Layer):
    """The one DP layer: each hook hands the step to :attr:`mechanism` (see the module docstring)."""

    key = "dp"
    provides = frozenset({SAMPLE, NOISE})
    needs = frozenset({BOUNDED, SUM})

    def __init__(self, mechanism: Mechanism) -> None:
        self.mechanism = mechanism

    @classmethod
    def central(cls, spec: DPSpec | str, clients_per_round: int,
                seeded: int | None = None) -> DifferentialPrivacyLayer:
        """Central DP from its spec (``"gaussian:noise=z,clip=C,delta=...,budget=..."``, adaptive
        clipping too; ``tier=leaf``/``tier=root`` beyond one SuperLink), sampling each connected
        device with probability clients-per-round over the run's population. A noise that adaptive
        clipping's count cannot share raises ``ValueError``. ``seeded`` (benchmarks only,
        ``dp-seeded-noise``): draw the noise and the sample from this seed, which makes the run
        reproducible and not private; its rows say so."""
        if isinstance(spec, str):
            parsed = parse_differential_privacy(spec)
            if parsed is None:
                raise ValueError(f"differential privacy {spec!r}: a spec is needed here, not 'none'")
            spec = parsed
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        return cls(central_mechanism(spec, clients_per_round, seeded))

    @classmethod
    def distributed(cls, spec: DPSpec, rate: Callable[[int], float], numel: int = 0, *,
                    rng: np.random.Generator | None = None,
                    sampler: random.Random | None = None) -> DifferentialPrivacyLayer:
        """Distributed DP under secure aggregation: ``rate(connected)`` is the step's sampling rate
        (the engine's clients-per-round over the population; a Flower app's ``fraction_train``).
        Adaptive clipping raises ``ValueError`` (it needs each device's fitted bit in clear)."""
        return cls(Skellam(spec, rate, numel, rng=rng, sampler=sampler))

    @property
    def spec(self) -> DPSpec:
        return self.mechanism.spec

    def select(self, nodes: list[int], count: int, key: int) -> list[int]:
        """The mechanism's Poisson sample, whatever ``count`` and ``key`` (DP runs are synchronous);
        :class:`~fedge.coordinator.layer.RunComplete` when the step would overspend the budget."""
        return self.mechanism.select(nodes)

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        clip = self.mechanism.stamp
        if clip is None:
            return
        for o in outgoing:  # this round's clipping bound, for the device's upload layer
            if CONFIG_RECORD in o.content.config_records:
                o.content.config_records[CONFIG_RECORD][DP_CLIP] = clip

    def update(self, step: Step, update: Update) -> Update:
        return self.mechanism.bound(update, self.scratch(step, dict))

    def release(self, step: Step, partial: Partial) -> Partial:
        scratch = self.scratch(step, dict)
        scratch["received"] = partial
        return self.mechanism.release(partial, step.connected, scratch)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        outcome.extra.update(self.mechanism.fields(self.scratch(step, dict)))
        outcome.train_loss = None

    def state_dict(self) -> dict[str, Any]:
        return self.mechanism.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError("the checkpoint has no privacy ledger: it was not a differentially private run")
        self.mechanism.load_state_dict(state)
