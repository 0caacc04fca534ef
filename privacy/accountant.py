"""Privacy accounting for client-level DP-FedAvg, through Google's ``dp-accounting``.

Each round is one Poisson-sampled Gaussian mechanism (sampling rate q, noise multiplier z), the
client-level analogue of DP-SGD's step (google-research/federated#20). Rounds compose. RDP (Mironov
2017) is used for budgeting, as the conservative bound and the cheap one to evaluate before every
round; the privacy loss distribution (PLD, Doroshenko et al. 2022), tighter, is what is reported.

The ledger is the list of (q, z) of the rounds run: that is the whole state, kept in the checkpoint,
so a resumed run recomputes exactly what it had spent, neither forgetting nor counting twice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fedge.privacy.distributed_dp import ORDERS, epsilon_from_rdp, skellam_rdp, subsampled_rdp_symmetric

__all__ = ["CoordinatorLedger", "PrivacyLedger", "SkellamLedger"]

logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's RDP warns per excluded order

#: The PLD's grid of privacy-loss values. Its rounding is pessimistic, so a coarser grid still bounds
#: epsilon from above; 1e-3 instead of dp-accounting's 1e-4 moved epsilon = 8.0067 (q = 0.1, z = 0.729,
#: 30 rounds) by +6e-6 and took a tenth of the CPU (0.08 s instead of 0.7 s; every row asks).
PLD_INTERVAL = 1e-3


def _event(q: float, z: float):  # type: ignore[no-untyped-def]
    import dp_accounting

    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


class PrivacyLedger:
    """The rounds a run has spent, and their epsilon at ``delta``."""

    def __init__(self, delta: float, rounds: Iterable[tuple[float, float]] = ()) -> None:
        self.delta = delta
        self.rounds: list[tuple[float, float]] = []
        for q, z in rounds:
            self.record(q, z)

    def record(self, q: float, z: float) -> None:
        if not 0 < q <= 1 or not z > 0:
            raise ValueError(f"a round needs a sampling rate in (0, 1] and a noise multiplier > 0, got q={q}, z={z}")
        self.rounds.append((float(q), float(z)))

    def _composed(self, extra: tuple[float, float] | None = None):  # type: ignore[no-untyped-def]
        import dp_accounting

        grouped: dict[tuple[float, float], int] = {}
        for q, z in self.rounds + ([extra] if extra else []):
            grouped[(q, z)] = grouped.get((q, z), 0) + 1
        return dp_accounting.ComposedDpEvent(
            [dp_accounting.SelfComposedDpEvent(_event(q, z), count) for (q, z), count in grouped.items()])

    def epsilon_rdp(self, extra: tuple[float, float] | None = None) -> float:
        from dp_accounting import rdp

        if not self.rounds and extra is None:
            return 0.0
        accountant = rdp.RdpAccountant()
        accountant.compose(self._composed(extra))
        return float(accountant.get_epsilon(self.delta))

    def epsilon_pld(self) -> float:
        from dp_accounting import pld

        if not self.rounds:
            return 0.0
        accountant = pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
        accountant.compose(self._composed())
        return float(accountant.get_epsilon(self.delta))

    def would_exceed(self, budget: float, q: float, z: float) -> bool:
        """Whether one more round at (q, z) would take RDP's epsilon past ``budget`` (0: no budget)."""
        return budget > 0 and self.epsilon_rdp((q, z)) > budget

    def state_dict(self) -> dict:
        return {"delta": self.delta, "rounds": [[q, z] for q, z in self.rounds]}

    @classmethod
    def from_state(cls, state: dict) -> "PrivacyLedger":
        try:
            return cls(float(state["delta"]), [(float(q), float(z)) for q, z in state["rounds"]])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"the checkpoint's privacy ledger is malformed: {error}") from None


class SkellamLedger:
    """The rounds of a run with distributed noise (the Skellam mechanism inside the secure-aggregation
    ring) and their epsilon at ``delta``, by RDP at integer orders: Agarwal, Kairouz and Liu 2021's
    bound, amplified by Poisson sampling as a symmetric mechanism (``subsampled_rdp_symmetric``),
    composed over rounds and converted as dp-accounting does. A round is (q, the released sum's
    noise variance, L1 and L2 sensitivity), all in the ring's integer units; that list is the whole
    state, kept in the checkpoint."""

    def __init__(self, delta: float, rounds: Iterable[tuple[float, float, float, float]] = ()) -> None:
        self.delta = delta
        self.rounds: list[tuple[float, float, float, float]] = []
        self._cache: dict[tuple[float, float, float, float], list[float]] = {}
        for r in rounds:
            self.record(*r)

    def record(self, q: float, variance: float, l1: float, l2: float) -> None:
        if not 0 < q <= 1 or not variance >= 0 or not (l1 > 0 and l2 > 0):
            raise ValueError(f"a Skellam round needs q in (0, 1], a variance >= 0 and positive sensitivities, "
                             f"got {q}, {variance}, {l1}, {l2}")
        self.rounds.append((float(q), float(variance), float(l1), float(l2)))

    def _rdp(self, round_: tuple[float, float, float, float]) -> list[float]:
        if round_ not in self._cache:
            q, variance, l1, l2 = round_
            self._cache[round_] = [subsampled_rdp_symmetric(a, q, lambda j: skellam_rdp(j, l1, l2, variance))
                                   for a in ORDERS]
        return self._cache[round_]

    def epsilon(self, extra: tuple[float, float, float, float] | None = None) -> float:
        rounds = self.rounds + ([extra] if extra else [])
        if not rounds:
            return 0.0
        total = [0.0] * len(ORDERS)
        for r in rounds:
            total = [t + v for t, v in zip(total, self._rdp(r))]
        return epsilon_from_rdp(total, self.delta)

    def would_exceed(self, budget: float, round_: tuple[float, float, float, float]) -> bool:
        return budget > 0 and self.epsilon(round_) > budget

    def state_dict(self) -> dict:
        return {"delta": self.delta, "skellam-rounds": [list(r) for r in self.rounds]}

    @classmethod
    def from_state(cls, state: dict) -> "SkellamLedger":
        try:
            return cls(float(state["delta"]), [tuple(float(v) for v in r) for r in state["skellam-rounds"]])  # type: ignore[misc]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"the checkpoint's distributed-DP ledger is malformed: {error}") from None


class CoordinatorLedger:
    """What distributed DP guarantees each device against the coordinator itself, per device.

    The amplified epsilon of :class:`SkellamLedger` holds against whoever sees the released models
    but not who was sampled. The coordinator draws the sample and sees who took part at every stage,
    so sampling hides nothing from it: against the coordinator a round that summed a device's update
    is the plain Skellam mechanism (no amplification) over that device's update, at the devices'
    noise in the sum (the device's own share included: under the coordinator's view the device took
    part in both neighbouring worlds, only its update differs, the "zero-out" adjacency; never the
    coordinator's own top-up, which it knows), and a round without it costs it nothing. Each
    device's rounds compose; the figure reported is the worst device's. A device is its node id: one
    that rejoins under a new id starts a new history (docs/privacy.md). State: per node, its distinct
    rounds (devices' noise variance, L1, L2, integer units) with their counts, kept in the
    checkpoint."""

    def __init__(self, delta: float, devices: dict[str, list[list[float]]] | None = None) -> None:
        self.delta = delta
        self.devices: dict[str, dict[tuple[float, float, float], int]] = {}
        #: one round's RDP at every order, by (variance, L1, L2): rows ask for every device's epsilon
        self._rdp: dict[tuple[float, float, float], list[float]] = {}
        for node, rounds in (devices or {}).items():
            for variance, l1, l2, count in rounds:
                key = (float(variance), float(l1), float(l2))
                self.devices.setdefault(str(node), {})[key] = int(count)

    def record(self, members: Iterable[object], variance: float, l1: float, l2: float) -> None:
        """One round whose unmasked sum held the updates of ``members`` and ``variance`` of noise."""
        if not variance > 0 or not (l1 > 0 and l2 > 0):
            raise ValueError(f"a round needs a positive variance and sensitivities, got {variance}, {l1}, {l2}")
        key = (float(variance), float(l1), float(l2))
        for node in members:
            rounds = self.devices.setdefault(str(node), {})
            rounds[key] = rounds.get(key, 0) + 1

    def rounds(self, node: object) -> int:
        return sum(self.devices.get(str(node), {}).values())

    def epsilon_of(self, node: object) -> float:
        rounds = self.devices.get(str(node), {})
        if not rounds:
            return 0.0
        total = [0.0] * len(ORDERS)
        for key, count in rounds.items():
            if key not in self._rdp:
                variance, l1, l2 = key
                self._rdp[key] = [skellam_rdp(alpha, l1, l2, variance) for alpha in ORDERS]
            total = [t + count * r for t, r in zip(total, self._rdp[key])]
        return epsilon_from_rdp(total, self.delta)

    def worst(self) -> tuple[float, int]:
        """(the largest epsilon of any device, the most rounds any device took part in)."""
        if not self.devices:
            return 0.0, 0
        return max(self.epsilon_of(node) for node in self.devices), max(self.rounds(n) for n in self.devices)

    def state_dict(self) -> dict:
        return {"delta": self.delta, "devices": {node: [[v, l1, l2, c] for (v, l1, l2), c in sorted(rounds.items())]
                                                for node, rounds in sorted(self.devices.items())}}

    @classmethod
    def from_state(cls, state: dict) -> "CoordinatorLedger":
        try:
            return cls(float(state["delta"]), {str(n): [list(map(float, r)) for r in rounds]
                                                for n, rounds in dict(state["devices"]).items()})
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"the checkpoint's per-device distributed-DP ledger is malformed: {error}") from None
