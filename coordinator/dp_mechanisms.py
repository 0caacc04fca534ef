"""The DP layer's mechanisms: what sampling, bounding, noising and accounting mean for each kind of
differential privacy (the layer, ``fedge.coordinator.dp_layer``, only hands them the step).

* :class:`Central` - DP-FedAvg with central noise (McMahan et al. 2018) on one SuperLink: Poisson
  sampling at the run's rate q, every decoded update clipped to L2 norm C (the devices clip too; this
  makes the bound hold whatever a device sends), uniform weights, Gaussian noise N(0, (zC)^2) added
  to the sum, divided by the expected number of devices qN (a fixed denominator: the realized count
  would leak membership); adaptive clipping (Andrew et al. 2021) moves C each round. The coordinator
  sees each clipped update before it adds noise: this protects the released models against whoever
  receives them, not the devices against the coordinator.
* :class:`LeafClip` and :class:`RootNoise` - the same mechanism split over a hierarchy
  (``tier=leaf`` / ``tier=root``, ``fedge.privacy.dp_spec``): a leaf samples its devices at the
  federation's rate q, clips, and passes the exact sum of the clipped updates up (no noise, no
  ledger); the root takes each leaf's sum whole (a leaf's sensitivity to one device is one clip; its
  bridge reports the devices it had connected, ``leaf-connected``), adds the noise once to the sum
  of sums, divides by q times those devices and keeps the ledger at rate q. The bridges send their
  sums uncompressed (``codec = "none"`` at the root), so nothing but the root's noise changes them.
* :class:`Skellam` - distributed DP: every sampled device clips, scales, rounds and adds its share
  of Skellam noise inside secure aggregation's ring (``fedge.privacy.distributed_dp``), so the
  coordinator never sees a noiseless sum; it samples, releases the unmasked sum plus its top-up for
  the planned devices that dropped, and keeps two ledgers:
  the amplified one and each device's against the coordinator (``dp_epsilon_coordinator``), which
  draws the sample and sees who took part.

The sample and the noise come from the operating system's CSPRNG (the noise from numpy's PCG64
seeded by it), never from the run seed: anyone who knows the seed could otherwise remove the noise
or learn who was sampled. A round whose sum could not be unmasked releases the previous model plus
noise of the same scale drawn here, so whether noise appears never depends on who answered.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedge.aggregation.partial import Partial
from fedge.compression import derive_seed
from fedge.coordinator.layer import RunComplete
from fedge.coordinator.step import Update
from fedge.privacy.accountant import CoordinatorLedger, PrivacyLedger, SkellamLedger
from fedge.privacy.distributed_dp import SkellamParams, ledger_round, released_sum, round_noise
from fedge.privacy.dp_spec import DPSpec
from fedge.privacy.sampling import RunRate, poisson_sample
from fedge.protocol.config_keys import DP_FITTED
from fedge.protocol.failures import Rejected
from fedge.protocol.leaf import LEAF_CONNECTED

__all__ = ["Central", "LeafClip", "Mechanism", "RootNoise", "Skellam", "central_mechanism"]

log = logging.getLogger(__name__)

#: where the noise's seed and the sample come from: the OS CSPRNG (names, so that a reproducibility
#: test can stand a deterministic source in for them; nothing in the product replaces them)
_os_entropy = os.urandom
_system_random = secrets.SystemRandom


class Mechanism:
    """What the DP layer asks of a mechanism, hook by hook (one that needs the model's size takes it
    as ``numel``, from its builder): ``select(nodes)`` (the step's sample;
    :class:`RunComplete` past the budget), ``stamp`` (the clip the messages carry; None: none),
    ``bound(update, scratch)``, ``release(partial, connected, scratch)``, ``fields(scratch)`` (the
    row's DP fields) and its state. ``scratch`` is the step's own dict (``received``: the partial
    the step released from); ``rate`` is the step's sampling rate q."""

    spec: DPSpec
    rate: float
    stamp: float | None = None

    def bound(self, update: Update, scratch: dict[str, Any]) -> Update:
        return update


def _budget_spent(spec: DPSpec) -> RunComplete:
    return RunComplete.budget_spent(spec.budget, spec.delta)


def _total(partial: Partial) -> torch.Tensor:
    """The partial's sum (zeros for an empty one)."""
    return partial.mean() * partial.count if partial.count else torch.zeros(partial.numel)


class Central(Mechanism):
    """Central Gaussian DP on one SuperLink (see the module docstring): q fixed for the run
    (``RunRate``: privacy audit 3, F5). Its state: the ledger, the noise and sample sources, the
    (adaptive) clipping bound; the tiers' mechanisms below are it with their step."""

    def __init__(self, spec: DPSpec, clients_per_round: int, seeded: int | None = None) -> None:
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
        self.run_rate = RunRate(clients_per_round, spec.population)
        if spec.adaptive:
            self.update_noise_multiplier(float(clients_per_round))  # refuses a noise the count cannot share

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
        return {**self.ledger.state_dict(), "clip": self.clip_bound, **self.run_rate.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ledger = PrivacyLedger.from_state(state)
        if ledger.delta != self.spec.delta:
            raise ValueError(f"the checkpoint accounted at delta={ledger.delta}, this run at {self.spec.delta}")
        clip = float(state.get("clip", self.spec.clip))
        if not (np.isfinite(clip) and clip > 0):
            raise ValueError(f"the checkpoint's clipping bound {clip!r} is not a positive number")
        self.ledger, self.clip_bound = ledger, clip
        self.run_rate.load_state_dict(state)

    def select(self, nodes: list[int]) -> list[int]:
        q = self.run_rate(len(nodes))
        if self.ledger.would_exceed(self.spec.budget, q, self.spec.noise):
            raise _budget_spent(self.spec)
        return self.sample_at(nodes, q)

    @property
    def stamp(self) -> float | None:
        return self.clip_bound

    def bound(self, update: Update, scratch: dict[str, Any]) -> Update:
        # the sensitivity bound holds whatever the device sent; every device counts once
        return dataclasses.replace(update, vector=self.clip(update.vector, update.metrics.get(DP_FITTED)), weight=1.0)

    def release(self, partial: Partial, connected: int, scratch: dict[str, Any]) -> Partial:
        """(sum of clipped updates + noise) / (q N)."""
        noisy = self.noisy_mean(_total(partial), connected)
        return Partial.of_mean(noisy, self.rate * connected, partial.count, members=partial.members,
                               planned=partial.planned, noised=True)

    def fields(self, scratch: dict[str, Any]) -> dict[str, Any]:
        return self.close_round()


class LeafClip(Central):
    """A leaf's part (``tier=leaf``): its devices sampled at the federation's rate, clipped, summed
    exactly for the root to noise; no noise and no ledger here (its root keeps it)."""

    def select(self, nodes: list[int]) -> list[int]:
        return self.sample_at(nodes, self.spec.rate)

    def release(self, partial: Partial, connected: int, scratch: dict[str, Any]) -> Partial:
        if not partial.count:
            return partial
        return Partial.of_mean(_total(partial), 1.0, partial.count, members=partial.members, planned=partial.planned)

    def fields(self, scratch: dict[str, Any]) -> dict[str, Any]:
        return {"dp_tier": "leaf", "dp_sampling_rate": self.spec.rate, "dp_clip": self.clip_bound}


class RootNoise(Central):
    """The root's part (``tier=root``): its nodes are the leaves' bridges, all asked every round;
    each leaf's sum is taken whole and the noise added once, over q times the devices the answering
    leaves had connected; the ledger at the federation's rate."""

    def select(self, nodes: list[int]) -> list[int]:
        if self.ledger.would_exceed(self.spec.budget, self.spec.rate, self.spec.noise):
            raise _budget_spent(self.spec)
        self.rate = self.spec.rate
        return list(nodes)

    stamp = None  # type: ignore[assignment]  # the nodes are bridges: a leaf's sum is not clipped again

    def bound(self, update: Update, scratch: dict[str, Any]) -> Update:
        """A leaf's sum of clipped updates, whole: one device moves it by one clip."""
        connected = update.metrics.get(LEAF_CONNECTED)
        if not isinstance(connected, (int, float)) or isinstance(connected, bool) or not 0 < connected < 1 << 31:
            raise Rejected(f"tier=root takes the sums of leaves' bridges, which report {LEAF_CONNECTED!r}; "
                           f"node {update.node} reported {connected!r}")
        scratch["devices"] = scratch.get("devices", 0) + int(connected)
        return dataclasses.replace(update, weight=1.0)

    def release(self, partial: Partial, connected: int, scratch: dict[str, Any]) -> Partial:
        devices = max(scratch.get("devices", 0), 1)
        return super().release(partial, devices, scratch)

    def fields(self, scratch: dict[str, Any]) -> dict[str, Any]:
        return {**self.close_round(), "dp_tier": "root"}


#: a Gaussian spec's tier -> its mechanism
_TIERS: dict[str, type[Central]] = {"": Central, "leaf": LeafClip, "root": RootNoise}


def central_mechanism(spec: DPSpec, clients_per_round: int, seeded: int | None = None) -> Central:
    """The Gaussian mechanism a spec's tier names."""
    return _TIERS[spec.tier](spec, clients_per_round, seeded)


class Skellam(Mechanism):
    """Distributed DP's coordinator part (see the module docstring), for both coordinators (Fedge's
    engine and ``fedge.flower``'s secure rounds run this layer): each planned device's share of a
    round's noise, the release, and the two ledgers, the amplified one (against whoever sees only
    the released models) and each device's against the coordinator, which draws the sample and sees
    who took part, so that sampling amplifies nothing against it. ``rate(connected)`` is the
    sampling rate q for a step with ``connected`` devices; ``rng`` (the top-up's and the noise-only
    release's generator) and ``sampler`` default to the OS CSPRNG."""

    def __init__(self, spec: DPSpec, rate: Callable[[int], float], numel: int = 0, *,
                 rng: np.random.Generator | None = None, sampler: random.Random | None = None) -> None:
        if spec.adaptive:
            raise ValueError("adaptive clipping needs each device's fitted bit in clear, which secure aggregation "
                             "hides; use a fixed clip")
        self.spec, self.numel = spec, numel
        self.ledger = SkellamLedger(spec.delta)
        self.coordinator = CoordinatorLedger(spec.delta)
        self._rate = rate
        self.rate = 0.0
        self.rng = rng if rng is not None else np.random.default_rng(int.from_bytes(_os_entropy(16), "little"))
        self._sampler = sampler if sampler is not None else _system_random()
        self.stamp = spec.clip  # the ring clips to it too

    def noise(self, planned: int) -> SkellamParams:
        """Each of the ``planned`` devices' share of the round's noise (what the secure plan carries)."""
        return round_noise(self.spec, self.numel, planned)

    def select(self, nodes: list[int]) -> list[int]:
        self.rate = self._rate(len(nodes))
        if self.ledger.would_exceed(self.spec.budget, ledger_round(self.spec, self.numel, self.rate)):
            raise _budget_spent(self.spec)
        return self.sample(nodes)

    def sample(self, nodes: list[int]) -> list[int]:
        """Each of ``nodes`` independently with probability q, from the sampler."""
        return poisson_sample(nodes, self.rate, self._sampler)

    def release(self, partial: Partial, connected: int, scratch: dict[str, Any]) -> Partial:
        """The devices' noisy sum (plus the top-up for the planned ones that dropped) over q N, or
        noise alone when no sum was unmasked: never a noiseless release. Recorded in the ledgers."""
        released = self.released_mean(partial.sum().numpy() if partial.count else None, self.rate, connected,
                                      list(partial.members), partial.planned, self.rng)
        return Partial.of_mean(torch.from_numpy(released.astype(np.float32)), max(self.rate * connected, 1.0),
                               partial.count, members=partial.members, planned=partial.planned, noised=True)

    def released_mean(self, noisy_sum: np.ndarray | None, q: float, connected: int, members: list[int],
                      planned: int, rng: np.random.Generator) -> np.ndarray:
        """The mean update a round releases, recorded in the ledgers: the unmasked noisy sum of the
        updates of ``members`` plus the coordinator's top-up for the ``planned`` devices that dropped,
        over the expected number of devices q N; or, when no sum was unmasked (``None``), noise of the
        same scale drawn here, on the same lattice, over q N. Every round is charged in the amplified
        ledger, with or without a sum: whether a round has one depends on the private sample (privacy
        audit 2, N4); against the coordinator only the members' rounds count.
        ``rng`` must be unpredictable (seeded from the OS CSPRNG)."""
        share = self.noise(planned)
        self.ledger.record(*ledger_round(self.spec, self.numel, q))
        if noisy_sum is not None and members:
            # the coordinator knows its own top-up: only the devices' noise counts against it
            self.coordinator.record(members, len(members) * share.local_variance, share.l1_bound, share.l2_bound)
        else:
            noisy_sum, members = None, []
        return released_sum(noisy_sum, share, planned, len(members), rng) / max(q * connected, 1.0)

    def fields(self, scratch: dict[str, Any]) -> dict[str, Any]:
        """RDP's epsilon only: no PLD for Skellam."""
        received: Partial | None = scratch.get("received")
        survivors, planned = (received.count, received.planned) if received is not None else (0, 0)
        epsilon = self.ledger.epsilon()
        against_coordinator, most = self.coordinator.worst()
        return {"dp_epsilon": epsilon, "dp_epsilon_rdp": epsilon, "dp_delta": self.spec.delta,
                "dp_sampling_rate": self.rate, "dp_noise_multiplier": self.spec.noise, "dp_clip": self.spec.clip,
                "dp_mechanism": "skellam", "dp_topped_up_devices": planned - survivors if survivors else 0,
                "dp_epsilon_coordinator": against_coordinator, "dp_coordinator_rounds": most}

    def state_dict(self) -> dict[str, Any]:
        rate_state = getattr(self._rate, "state_dict", None)
        return {**self.ledger.state_dict(), "coordinator": self.coordinator.state_dict(),
                **(rate_state() if rate_state is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self._rate, "load_state_dict"):
            self._rate.load_state_dict(state)
        ledger = SkellamLedger.from_state(state)
        if ledger.delta != self.spec.delta:
            raise ValueError(f"the checkpoint accounted at delta={ledger.delta}, this run at {self.spec.delta}")
        self.ledger = ledger
        if "coordinator" in state:
            self.coordinator = CoordinatorLedger.from_state(state["coordinator"])
        else:  # a checkpoint from before the per-device ledger was kept: its past rounds are not in it
            log.warning("the checkpoint has no per-device ledger: epsilon against the coordinator counts only "
                        "the rounds from here on")
