"""Client-level differential privacy on the coordinator (``differential-privacy = "gaussian:..."``).

DP-FedAvg with central noise: Poisson sampling at rate q, every decoded update clipped to L2 norm C
(the devices clip too; this makes the bound hold whatever a device sends), uniform weights, Gaussian
noise N(0, (zC)^2) added to the sum, and the sum divided by the expected number of devices qN (a
fixed denominator: the realized count would leak membership). The sample comes from the operating
system's CSPRNG and the noise from numpy's PCG64 seeded by it, never from the run seed: anyone who
knows the seed could otherwise remove the noise or learn who was sampled. The accountant's ledger
is checkpointed. Rows under DP carry no training loss (a noiseless aggregate of the devices' data).

The coordinator sees each clipped update before it adds noise: this protects the released models
(and everything derived from them) against whoever receives them, not the devices against the
coordinator. With secure aggregation the devices add the noise inside the ring and the coordinator
never sees a noiseless sum: distributed DP, whose coordinator side is the layer both coordinators
run (``fedge.coordinator.distributed_dp_layer``); this module builds it and refuses what it cannot do.

As a layer of the engine (``fedge.server.engine.layers``): it replaces the step's sample (Poisson),
ends the run before a step would overspend the budget, stamps each message with the round's
clipping bound (``dp-clip``: the device clips in its upload layer), clips every decoded update and
weighs it 1 (after the update guard: it ``needs`` ``BOUNDED``), noises the step's released
:class:`~fedge.aggregation.partial.Partial` (after secure aggregation unmasked it: it ``needs``
``SUM``), and records the round in the ledger. The algorithm (FedAvg) knows none of it.

The released partial is always released, whatever the number of updates: a step with fewer than
``min-replies`` updates, or none, still publishes a noised model. Releasing the previous model
unnoised instead would let who took part decide whether noise is added, which the accountant
(which records every round as a noised one) does not count.

Beyond one SuperLink the mechanism is split by tier (``tier=leaf`` / ``tier=root`` in the spec,
``fedge.privacy.dp_spec``): a leaf samples its devices at the federation's rate q, clips, and passes
the exact sum of the clipped updates up (no noise, no ledger: its step's model is the root's model
plus that sum, which only its bridge reads); the root takes each leaf's sum whole (a leaf's
sensitivity to one device is one clip; its bridge reports the devices it had connected,
``leaf-connected``), adds the noise once to the sum of sums, divides by q times those devices, and
keeps the ledger at rate q. The bridges send their sums uncompressed (``codec = "none"`` at the
root), so nothing but the root's noise changes them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import secrets
from typing import Any

import numpy as np
import torch

from fedge.aggregation.partial import Partial
from fedge.compression import derive_seed
from fedge.privacy.accountant import PrivacyLedger
from fedge.privacy.dp_spec import DPSpec, parse_differential_privacy
from fedge.privacy.sampling import RunRate, poisson_sample
from fedge.protocol import CONFIG_RECORD
from fedge.protocol.config_keys import DP_CLIP, DP_FITTED
from fedge.protocol.leaf import LEAF_CONNECTED
from fedge.coordinator.step import Outgoing, Step, StepOutcome, Update
from fedge.protocol.failures import Rejected
from fedge.coordinator.layer import BOUNDED, NOISE, SAMPLE, SUM, Layer, RunComplete
from fedge.coordinator.tally import Tally

__all__ = ["CentralDP", "DifferentialPrivacyLayer"]

log = logging.getLogger(__name__)

#: where the noise's seed and the sample come from: the OS CSPRNG (names, so that a reproducibility
#: test can stand a deterministic source in for them; nothing in the product replaces them)
_os_entropy = os.urandom
_system_random = secrets.SystemRandom


class DifferentialPrivacyLayer(Layer):
    key = "dp"
    provides = frozenset({SAMPLE, NOISE})
    needs = frozenset({BOUNDED, SUM})

    def __init__(self, dp: CentralDP, clients_per_round: int) -> None:
        self.dp = dp
        self.tier = dp.spec.tier  # "" (one tier), "leaf" or "root"
        self.clients_per_round = clients_per_round
        #: one tier: q fixed for the run (audit 3, F5); with leaves the spec's rate is the federation's
        self.run_rate = RunRate(clients_per_round, dp.spec.population)

    @classmethod
    def central(cls, spec: DPSpec | str, clients_per_round: int,
                seeded: int | None = None) -> DifferentialPrivacyLayer:
        """Central DP from its spec (``"gaussian:noise=z,clip=C,delta=...,budget=..."``, adaptive
        clipping too), sampling each connected device with probability clients-per-round over their
        number. The engine builds it from its settings; a Flower app hands it to
        ``fedge.flower.layered(strategy, DifferentialPrivacyLayer.central(...))``. A noise that
        adaptive clipping's count cannot share raises ``ValueError``. ``seeded``
        (benchmarks only, ``dp-seeded-noise``): draw the noise and the sample from this seed, which
        makes the run reproducible and not private; its rows say so."""
        if isinstance(spec, str):
            parsed = parse_differential_privacy(spec)
            if parsed is None:
                raise ValueError(f"differential privacy {spec!r}: a spec is needed here, not 'none'")
            spec = parsed
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        dp = CentralDP(spec, seeded=seeded)
        if spec.adaptive:
            dp.update_noise_multiplier(float(clients_per_round))  # refuses a noise the count cannot share
        return cls(dp, clients_per_round)

    def select(self, nodes: list[int], count: int, key: int) -> list[int]:
        """Poisson sampling from the OS CSPRNG at rate clients-per-round / connected (what the
        accountant assumes), whatever ``count`` and ``key`` (DP runs are synchronous). With leaves:
        a leaf samples its devices at the federation's rate; the root asks every leaf. Raises
        :class:`RunComplete` when one more round would spend more than the budget."""
        if self._spent(len(nodes)):
            raise RunComplete.budget_spent(self.dp.spec.budget, self.dp.spec.delta)
        if self.tier == "root":
            self.dp.rate = self.dp.spec.rate
            return list(nodes)
        if self.tier == "leaf":
            return self.dp.sample_at(nodes, self.dp.spec.rate)
        return self.dp.sample_at(nodes, self.run_rate(len(nodes)))

    def _spent(self, connected: int) -> bool:
        if self.tier == "leaf":  # the root keeps the ledger; a leaf steps when its root asks
            return False
        q = self.dp.spec.rate if self.tier == "root" else self.run_rate(connected)
        return self.dp.ledger.would_exceed(self.dp.spec.budget, q, self.dp.spec.noise)

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        if self.tier == "root":  # the root's nodes are bridges: a leaf's sum is not clipped again
            return
        for o in outgoing:  # this round's clipping bound, for the device's upload layer
            if CONFIG_RECORD in o.content.config_records:
                o.content.config_records[CONFIG_RECORD][DP_CLIP] = self.dp.clip_bound

    def update(self, step: Step, update: Update) -> Update:
        if self.tier == "root":  # a leaf's sum of clipped updates, whole: one device moves it by one clip
            connected = update.metrics.get(LEAF_CONNECTED)
            if not isinstance(connected, (int, float)) or isinstance(connected, bool) or not 0 < connected < 1 << 31:
                raise Rejected(f"tier=root takes the sums of leaves' bridges, which report {LEAF_CONNECTED!r}; "
                               f"node {update.node} reported {connected!r}")
            scratch = self.scratch(step, dict)
            scratch["devices"] = scratch.get("devices", 0) + int(connected)
            return dataclasses.replace(update, weight=1.0)
        # the sensitivity bound holds whatever the device sent; every device counts once
        vector = self.dp.clip(update.vector, update.metrics.get(DP_FITTED))
        return dataclasses.replace(update, vector=vector, weight=1.0)

    def release(self, step: Step, partial: Partial) -> Partial:
        """The noised release: DP-FedAvg's (sum of clipped updates + noise) / (q N), or under
        distributed DP the unmasked sum (which carries the survivors' noise) plus the coordinator's
        top-up for the planned devices that dropped, / (q N). A round whose sum could not be
        unmasked releases the previous model plus noise of the same scale drawn here (no device's
        data is in it), so that whether noise appears, and how much, never depends on who answered."""
        self.scratch(step, dict)["received"] = partial
        count = partial.count
        if self.tier == "leaf":  # the exact sum of the clipped updates, for the root to noise
            if not count:
                return partial
            return Partial.of_mean(partial.mean() * count, 1.0, count, members=partial.members, planned=partial.planned)
        if self.tier == "root":  # the leaves' devices are the federation: q times those the answering leaves had
            total = partial.mean() * count if count else torch.zeros(partial.numel)
            devices = self.scratch(step, dict).get("devices", 0)
            noisy = self.dp.noisy_mean(total, max(devices, 1))
            expected = self.dp.rate * max(devices, 1)
            return Partial.of_mean(noisy, expected, count, members=partial.members, planned=partial.planned,
                                   noised=True)
        total = partial.mean() * count if count else torch.zeros(partial.numel)
        noisy = self.dp.noisy_mean(total, step.connected)
        expected = self.dp.rate * step.connected
        return Partial.of_mean(noisy, expected, count, members=partial.members, planned=partial.planned, noised=True)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        if self.tier == "leaf":  # no release here: the root accounts for it
            outcome.extra.update({"dp_tier": "leaf", "dp_sampling_rate": self.dp.spec.rate,
                                  "dp_clip": self.dp.clip_bound})
        else:
            outcome.extra.update(self.dp.close_round())
            if self.tier == "root":
                outcome.extra["dp_tier"] = "root"
        # The devices' mean training loss is a noiseless aggregate of their private data: not in
        # the row. (Who took part, clients_used and the rejected nodes, stay: the coordinator's
        # operator sees them anyway; they are not released with the model. docs/privacy.md)
        outcome.train_loss = None

    def state_dict(self) -> dict[str, Any]:
        return {**self.dp.state_dict(), **self.run_rate.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError("the checkpoint has no privacy ledger: it was not a differentially private run")
        self.dp.load_state_dict(state)
        self.run_rate.load_state_dict(state)


class CentralDP:
    def __init__(self, spec: DPSpec, seeded: int | None = None) -> None:
        self.spec = spec
        self.ledger = PrivacyLedger(spec.delta)
        #: None: private. A seed (``dp-seeded-noise``, benchmarks only): noise and sample from it
        self.seeded = seeded
        if seeded is None:
            # The noise: numpy's PCG64 seeded with 128 bits from the OS CSPRNG (never the run seed):
            # unpredictable to whoever knows the run's settings, and fast enough for model-sized draws.
            self._rng = np.random.default_rng(int.from_bytes(_os_entropy(16), "little"))
            #: the sample: straight from the OS CSPRNG (one draw per connected device)
            self._sampler: random.Random = _system_random()
        else:
            log.warning("dp-seeded-noise: DP noise and sample come from the run seed; this run is NOT private")
            self._rng = np.random.default_rng(derive_seed(seeded, purpose="dp-noise"))
            self._sampler = random.Random(derive_seed(seeded, purpose="dp-sample"))
        self.rate = 0.0
        #: the current clipping bound (moves each round when adaptive) and this round's sum of the
        #: devices' centred bits, +1/2 when a device's update fitted under the bound, -1/2 when not
        self.clip_bound = spec.clip
        self.fitted = 0.0
        self._expected = 1.0
        #: adaptive clipping: the m of the count's noise sigma_b = m / 20, fixed when the run is
        #: built (clients-per-round). The guarantee does not depend on m (the count's sensitivity is
        #: 1/2 whatever it is); taking it from each round's connected devices let a round with fewer
        #: of them than clients-per-round break z < 2 sigma_b mid-run (privacy audit 2, N8)
        self.count_devices = 1.0

    def _count_noise_std(self) -> float:
        """Andrew et al.'s sigma_b = m / 20 for the m expected devices the run was built for."""
        return max(self.count_devices, 1.0) / 20.0

    def update_noise_multiplier(self, expected: float | None = None) -> float:
        """z for the update's noise: all of it, or (adaptive) what is left after the count's share.
        ``expected``: set the count's m (when the run is built); refused when the noise cannot be split."""
        z = self.spec.noise
        if not self.spec.adaptive:
            return z
        if expected is not None:
            self.count_devices = float(expected)
        sigma_b = self._count_noise_std()
        if z >= 2 * sigma_b:
            raise ValueError(f"adaptive clipping: noise {z:g} must stay below 2 sigma_b = {2 * sigma_b:g} "
                                f"(m/10 for {self.count_devices:g} expected devices); sample more devices or use "
                                "less noise")
        return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5

    def sample_at(self, nodes: list[int], rate: float) -> list[int]:
        """Poisson sampling at ``rate`` (a leaf's: the federation's q)."""
        self.rate = rate
        return poisson_sample(nodes, rate, self._sampler)

    def clip(self, vector: torch.Tensor, fitted: object = None) -> torch.Tensor:
        """Bound one decoded update; count the device's bit (``fitted``, or None: the update is the
        device's own, unclipped), centred: +1/2 if its own update fitted under the bound, -1/2 if not. Centred, adding or removing one device moves the count by at
        most 1/2, the sensitivity Andrew et al.'s split of the noise, z^-2 = z_update^-2 + (2 sigma_b)^-2,
        assumes (summing {0, 1} bits, as before 2026-11-25, moved it by 1 and under-reported epsilon)."""
        norm = float(vector.norm())
        if self.spec.adaptive:  # a device that did not clip (a Flower app's node) sent its own update: its norm says
            bit = norm <= self.clip_bound if fitted is None else fitted in (1, 1.0, True)
            self.fitted += 0.5 if bit else -0.5
        if norm > self.clip_bound:
            return vector * (self.clip_bound / norm)
        return vector

    def noisy_mean(self, total: torch.Tensor, connected: int) -> torch.Tensor:
        """(sum of clipped updates + N(0, (z_update C)^2)) / (q N)."""
        self._expected = self.rate * connected
        std = self.update_noise_multiplier() * self.clip_bound
        noise = self._rng.normal(0.0, std, size=total.numel()).astype(np.float32)
        return (total + torch.from_numpy(noise)) / self._expected

    def close_round(self) -> dict[str, Any]:
        """Record the round in the ledger, move an adaptive bound; the metrics row's DP fields."""
        self.ledger.record(self.rate, self.spec.noise)
        fields = {"dp_epsilon": self.ledger.epsilon_pld(), "dp_epsilon_rdp": self.ledger.epsilon_rdp(),
                  "dp_delta": self.spec.delta, "dp_sampling_rate": self.rate, "dp_noise_multiplier": self.spec.noise,
                  "dp_clip": self.clip_bound,  # not the count of clipped updates: unnoised (audit 2, N7)
                  # false when the noise came from the run seed (dp-seeded-noise): a benchmark, not private
                  "dp_private": self.seeded is None}
        if self.spec.adaptive:  # the noisy fraction of devices under the bound, released and used
            sigma_b = self._count_noise_std()
            fraction = (self.fitted + self._rng.normal(0.0, sigma_b)) / self._expected + 0.5
            self.clip_bound *= float(np.exp(-self.spec.clip_lr * (fraction - self.spec.quantile)))
            fields["dp_fraction_under_clip"] = fraction
        self.fitted = 0.0
        return fields

    def state_dict(self) -> dict[str, Any]:
        return {**self.ledger.state_dict(), "clip": self.clip_bound}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ledger = PrivacyLedger.from_state(state)
        if ledger.delta != self.spec.delta:
            raise ValueError(f"the checkpoint accounted at delta={ledger.delta}, this run at {self.spec.delta}")
        clip = float(state.get("clip", self.spec.clip))
        if not (np.isfinite(clip) and clip > 0):
            raise ValueError(f"the checkpoint's clipping bound {clip!r} is not a positive number")
        self.ledger, self.clip_bound = ledger, clip
