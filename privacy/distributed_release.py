"""Distributed DP's coordinator side, once, for both coordinators.

The devices clip, scale, round and add their share of Skellam noise inside the secure-aggregation
ring (``fedge.privacy.distributed_dp``); the coordinator only sizes the shares, releases and
accounts. Fedge's engine (its DP layer) and ``fedge.flower.secure`` in a user's ServerApp both do it
through :class:`DistributedRelease`, so the two cannot drift: the same shares in the plan, the same
top-up, the same noise-only release when no sum could be unmasked, the same two ledgers.
"""

from __future__ import annotations

import numpy as np

from fedge.privacy.accountant import CoordinatorLedger, SkellamLedger
from fedge.privacy.distributed_dp import SkellamParams, ledger_round, released_sum, round_noise
from fedge.privacy.dp_spec import DPSpec

__all__ = ["DistributedRelease"]


class DistributedRelease:
    """Each planned device's share of a round's noise, the round's release, and the ledgers: the
    amplified one (against whoever sees only the released models) and each device's against the
    coordinator, which draws the sample and sees who took part, so that sampling amplifies nothing
    against it."""

    def __init__(self, spec: DPSpec, numel: int = 0) -> None:
        if spec.adaptive:
            raise ValueError("adaptive clipping needs each device's fitted bit in clear, which secure aggregation "
                             "hides; use a fixed clip")
        self.spec, self.numel = spec, numel
        self.ledger = SkellamLedger(spec.delta)
        self.coordinator = CoordinatorLedger(spec.delta)

    def noise(self, planned: int) -> SkellamParams:
        """Each of the ``planned`` devices' share of the round's noise (what the secure plan carries)."""
        return round_noise(self.spec, self.numel, planned)

    def would_exceed(self, q: float) -> bool:
        """Whether one more round at sampling rate ``q`` would spend more than the budget (0: none)."""
        return self.ledger.would_exceed(self.spec.budget, ledger_round(self.spec, self.numel, q))

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

    def state_dict(self) -> dict:
        return {**self.ledger.state_dict(), "coordinator": self.coordinator.state_dict()}

    def load_state_dict(self, state: dict) -> bool:
        """Restore :meth:`state_dict`'s output; False when it holds no per-device ledger (a checkpoint
        from before it was kept: its past rounds are not in it)."""
        ledger = SkellamLedger.from_state(state)
        if ledger.delta != self.spec.delta:
            raise ValueError(f"the checkpoint accounted at delta={ledger.delta}, this run at {self.spec.delta}")
        self.ledger = ledger
        if "coordinator" not in state:
            return False
        self.coordinator = CoordinatorLedger.from_state(state["coordinator"])
        return True
