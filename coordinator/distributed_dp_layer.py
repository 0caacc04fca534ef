"""Distributed DP as a layer, once for both coordinators: the devices add the noise inside secure
aggregation's ring, the coordinator samples, releases and accounts.

Every sampled device clips its update to L2 norm C, scales and rounds it, and adds its share of
Skellam noise before masking (``fedge.privacy.distributed_dp``), so the coordinator never sees a
noiseless sum. This layer is the coordinator's part, through the one mechanism
(``fedge.privacy.distributed_release``):

- the sample: Poisson at rate q from the OS CSPRNG, what the accountant's amplification assumes;
  the rate is the adapter's (Fedge's engine: clients-per-round over the connected devices; a
  Flower app: its strategy's ``fraction_train``);
- the release: the unmasked sum, plus the coordinator's top-up for the planned devices that
  dropped, over the expected number of devices q N (every device weighs the same); a round whose
  sum could not be unmasked releases the current model plus noise of the same scale drawn here,
  so whether noise appears never depends on who answered;
- the ledgers: the amplified one (Agarwal, Kairouz and Liu 2021's Skellam RDP) and each device's
  against the coordinator, which draws the sample and sees who took part, so that sampling
  amplifies nothing against it (``dp_epsilon_coordinator``); a step that would take epsilon past
  the budget is not run.

Fedge's engine builds it from its settings (``coordinator/central_dp_layer.py``, which
also holds central DP); ``fedge.flower.secure(..., differential_privacy=...)`` hands it to the same
wrapper as the secure-aggregation layer. Its row fields are the same in both (in a Flower app,
the round's train metrics). Adaptive clipping is refused (it needs each device's fitted bit in clear).
"""

from __future__ import annotations

import logging
import os
import random
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedge.aggregation.partial import Partial
from fedge.privacy.distributed_release import DistributedRelease
from fedge.privacy.dp_spec import DPSpec
from fedge.privacy.sampling import poisson_sample
from fedge.protocol.config_keys import DP_CLIP
from fedge.coordinator.layer import BOUNDED, NOISE, SAMPLE, SUM, Layer, RunComplete
from fedge.protocol.records import CONFIG_RECORD
from fedge.coordinator.step import Outgoing, Step, StepOutcome
from fedge.coordinator.tally import Tally

__all__ = ["DistributedDP"]

log = logging.getLogger(__name__)


class DistributedDP(DistributedRelease, Layer):
    """The coordinator's part of distributed DP (see the module docstring). ``rate(connected)`` is
    the sampling rate q for a step with ``connected`` devices; ``rng`` (the top-up's and the
    noise-only release's generator) and ``sampler`` default to the OS CSPRNG."""

    key = "dp"
    provides = frozenset({SAMPLE, NOISE})
    needs = frozenset({BOUNDED, SUM})  # it noises the sum secure aggregation unmasked

    def __init__(self, spec: DPSpec, rate: Callable[[int], float], numel: int = 0, *,
                 rng: np.random.Generator | None = None, sampler: random.Random | None = None) -> None:
        super().__init__(spec, numel)
        self._rate = rate
        #: this step's sampling rate q, set when it samples
        self.rate = 0.0
        self.rng = rng if rng is not None else np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
        self._sampler = sampler if sampler is not None else secrets.SystemRandom()

    def start(self, params: torch.Tensor) -> None:
        self.numel = self.numel or int(params.numel())

    def select(self, nodes: list[int], count: int, key: int) -> list[int]:
        """The step's Poisson sample, whatever ``count`` and ``key``; :class:`RunComplete` when the
        step would take epsilon past the budget."""
        self.rate = self._rate(len(nodes))
        if self.would_exceed(self.rate):
            raise RunComplete.budget_spent(self.spec.budget, self.spec.delta)
        return self.sample(nodes)

    def sample(self, nodes: list[int]) -> list[int]:
        """Each of ``nodes`` independently with probability q, from the sampler."""
        return poisson_sample(nodes, self.rate, self._sampler)

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        for o in outgoing:  # the clipping bound, for the device's upload layer (the ring clips to it too)
            if CONFIG_RECORD in o.content.config_records:
                o.content.config_records[CONFIG_RECORD][DP_CLIP] = self.spec.clip

    def release(self, step: Step, partial: Partial) -> Partial:
        """The devices' noisy sum (plus the top-up for the planned ones that dropped) over q N, or
        noise alone when no sum was unmasked: never a noiseless release. Recorded in the ledgers."""
        self.scratch(step, dict)["received"] = partial
        count, connected = partial.count, step.connected
        released = self.released_mean(partial.sum().numpy() if count else None, self.rate, connected,
                                      list(partial.members), partial.planned, self.rng)
        return Partial.of_mean(torch.from_numpy(released.astype(np.float32)), max(self.rate * connected, 1.0),
                               count, members=partial.members, planned=partial.planned, noised=True)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        """The row's DP fields (RDP's epsilon only: no PLD for Skellam). The devices' mean training
        loss is a noiseless aggregate of their private data: not in the row."""
        received: Partial | None = self.scratch(step, dict).get("received")
        survivors, planned = (received.count, received.planned) if received is not None else (0, 0)
        epsilon = self.ledger.epsilon()
        against_coordinator, most = self.coordinator.worst()
        outcome.extra.update({
            "dp_epsilon": epsilon, "dp_epsilon_rdp": epsilon, "dp_delta": self.spec.delta,
            "dp_sampling_rate": self.rate, "dp_noise_multiplier": self.spec.noise, "dp_clip": self.spec.clip,
            "dp_mechanism": "skellam", "dp_topped_up_devices": planned - survivors if survivors else 0,
            "dp_epsilon_coordinator": against_coordinator, "dp_coordinator_rounds": most})
        outcome.train_loss = None

    def state_dict(self) -> dict:
        rate_state = getattr(self._rate, "state_dict", None)
        return {**DistributedRelease.state_dict(self), **(rate_state() if rate_state is not None else {})}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:  # type: ignore[override]
        if state is None:
            raise ValueError("the checkpoint has no privacy ledger: it was not a differentially private run")
        if hasattr(self._rate, "load_state_dict"):
            self._rate.load_state_dict(state)
        if not DistributedRelease.load_state_dict(self, state):
            log.warning("the checkpoint has no per-device ledger: epsilon against the coordinator counts only "
                        "the rounds from here on")
