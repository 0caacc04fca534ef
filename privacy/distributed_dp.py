"""Distributed DP inside the secure-aggregation ring: the Skellam mechanism (Agarwal, Kairouz and
Liu, NeurIPS 2021), so that the coordinator never sees a noiseless sum.

Each sampled device clips its update to L2 norm C, scales it by s, rounds it to integers with
*conditional* randomized rounding (Kairouz, Liu and Steinke 2021: redrawn until the rounded
vector's norm is within a bound, so the sensitivity holds for every upload), adds Skellam noise
Sk(mu_local) = Poisson(mu_local / 2) - Poisson(mu_local / 2) to every coordinate, and masks the
result as a ring element. Skellam is closed under addition: the unmasked sum carries
Sk(k mu_local) for k surviving devices, integer noise that modular arithmetic never rounds.

The ring is sized before the round for the worst case: every device at its coordinate bound, plus
a tail bound on the summed noise (Bernstein's inequality for a sum of centred Poisson variables:
P(|Sk(mu)| >= t) <= 2 exp(-t^2 / (2 (mu + t/3)))), at a failure probability of 2^-40 over all
coordinates, so the sum cannot wrap.

The released sum carries a fixed total noise, Sk(V) with V = (z D2)^2 in integer units, whoever
took part: each of the k devices planned into the round adds Sk(V / k) (k is in the plan, so the
share is sized for the sample actually drawn), and the coordinator adds the shares of those that
dropped before their masked upload, Sk((k - survivors) V / k), after unmasking. So the noise's level
depends on nobody's membership: the released sum is exactly the Poisson-subsampled Skellam
mechanism at variance V (no crediting rule, and the noise's spread no longer shows the sample's
size). Against the coordinator, which knows its own top-up and who took part, a device's round is
worth the devices' noise only, survivors * V / k, unamplified (``CoordinatorLedger``).

Accounting (RDP, integer orders): one round is the Skellam mechanism with L2 and L1 sensitivities
of one device's rounded vector and variance V, amplified by Poisson sampling at rate q. The
mechanism is symmetric (reflecting the output about the midpoint of the two sums swaps the
neighbouring distributions, as Skellam noise is symmetric), and for a symmetric mechanism the
"add" direction of Poisson sampling never exceeds the "remove" one (``subsampled_rdp_symmetric``,
proof in docs/privacy.md), whose binomial expansion is exact: the bound is the sampled Gaussian's
own formula with Skellam's RDP in place of the Gaussian's, not Zhu and Wang's general bound (its
factor 3 on the higher terms), which ``subsampled_rdp`` keeps for mechanisms without that symmetry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedge.privacy.dp_spec import DPSpec
from fedge.privacy.errors import RingError

__all__ = [
    "SkellamParams",
    "encode",
    "decode_sum",
    "skellam_tail",
    "skellam_rdp",
    "subsampled_rdp",
    "subsampled_rdp_symmetric",
    "epsilon_from_rdp",
    "ORDERS",
    "skellam_params",
    "round_noise",
    "ledger_round",
    "top_up",
    "released_sum",
    "centred",
]

#: integer Renyi orders the accountant minimises over
ORDERS: tuple[int, ...] = tuple(range(2, 65)) + tuple(range(72, 129, 8))
#: the probability, per round, that the summed noise leaves the ring's headroom anywhere
TAIL_LOG2 = -40
#: conditional rounding: the norm bound holds with probability 1 - beta per draw (e^-1/2, TFF's)
BETA = math.exp(-0.5)
_MAX_REDRAWS = 1000
#: integers per model unit, squared, per coordinate and per unit of clip: s = sqrt(SCALE_SQUARED d) / C.
#: Conditional rounding's bound is about sqrt(s^2 C^2 + d/4), so the released noise, sized to that
#: bound, is sqrt(1 + 1 / (4 SCALE_SQUARED)) times the noise a central mechanism needs for the clip:
#: 2.5% at 5 (the first release), 0.6% at 20, for one more ring bit (2.7% and 0.75% with the
#: bound's other terms, at the 9,098 coordinates of the small Fashion-MNIST model).
SCALE_SQUARED = 20


@dataclass(frozen=True)
class SkellamParams:
    """The public parameters of one round's distributed noise (they travel in the secagg plan)."""

    #: L2 clipping bound of a device's update, in model units
    clip: float
    #: integers per model unit: the update is multiplied by this before rounding
    scale: float
    #: Skellam variance each device adds to every coordinate, in integer units
    local_variance: float
    #: coordinates of a device's vector
    dimension: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0 and math.isfinite(self.scale) and self.scale > 0):
            raise RingError(f"distributed DP needs a positive clip and scale, got {self.clip}, {self.scale}")
        if not (math.isfinite(self.local_variance) and self.local_variance > 0) or self.dimension < 1:
            raise RingError("distributed DP needs a positive noise variance and dimension")

    @property
    def l2_bound(self) -> float:
        """The L2 norm every rounded vector is held to (Kairouz et al. 2021, conditional rounding):
        sqrt(s^2 C^2 + d/4 + sqrt(2 ln(1/beta)) (s C + sqrt(d)/2)), never above s C + sqrt(d)."""
        sc, d = self.scale * self.clip, self.dimension
        conditional = math.sqrt(sc * sc + d / 4 + math.sqrt(2 * math.log(1 / BETA)) * (sc + math.sqrt(d) / 2))
        return min(conditional, sc + math.sqrt(d))

    @property
    def l1_bound(self) -> float:
        """For integers, |x|_1 <= |x|_2^2, and always |x|_1 <= sqrt(d) |x|_2."""
        l2 = self.l2_bound
        return min(l2 * l2, math.sqrt(self.dimension) * l2)

    @property
    def coordinate_bound(self) -> int:
        """No coordinate of a rounded vector exceeds its L2 norm."""
        return int(math.floor(self.l2_bound))

    def magnitude(self, devices: int) -> int:
        """No coordinate of the sum of ``devices`` honest noisy vectors exceeds this (but with
        probability 2^-40): each at its coordinate bound, plus the summed noise's tail bound."""
        return devices * self.coordinate_bound + skellam_tail(devices * self.local_variance, self.dimension)

    def ring_bits(self, devices: int) -> int:
        """The ring that holds the sum of ``devices`` noisy vectors without wrapping (signed)."""
        bits = math.ceil(math.log2(2 * self.magnitude(devices) + 1))
        if bits > 32:
            raise RingError(f"distributed DP for {devices} devices needs a {bits}-bit ring; at most 32 are "
                            "supported (lower the scale, or sample fewer devices)")
        return bits


def skellam_tail(variance: float, coordinates: int, log2_failure: float = TAIL_LOG2) -> int:
    """t such that P(some of ``coordinates`` Sk(variance) values has |x| >= t) <= 2^log2_failure,
    from 2 d exp(-t^2 / (2 (mu + t/3))) <= 2^log2_failure, solved for t."""
    if variance <= 0:
        return 0
    log_budget = log2_failure * math.log(2) - math.log(2 * coordinates)  # ln of the per-coordinate bound
    a = -log_budget  # t^2 = 2 a (mu + t/3)  ->  t = a/3 + sqrt(a^2/9 + 2 a mu)
    return int(math.ceil(a / 3 + math.sqrt(a * a / 9 + 2 * a * variance)))


def _skellam(variance: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Sk(variance) = Poisson(variance / 2) - Poisson(variance / 2), ``size`` draws (int64)."""
    return rng.poisson(variance / 2, size) - rng.poisson(variance / 2, size)


def _round_conditionally(scaled: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    floor = np.floor(scaled)
    frac = scaled - floor
    for _ in range(_MAX_REDRAWS):
        rounded = floor + (rng.random(scaled.shape) < frac)
        if float(np.linalg.norm(rounded)) <= bound:
            return rounded.astype(np.int64)
    raise RingError(f"conditional rounding found no vector within norm {bound} in {_MAX_REDRAWS} draws")


def encode(update: np.ndarray, params: SkellamParams, bits: int, rng: np.random.Generator) -> np.ndarray:
    """A device's ring elements: clip to C, scale, round conditionally, add Sk(mu_local), mod 2^bits.
    ``rng`` must be unpredictable to the coordinator (seeded from the OS CSPRNG)."""
    x = np.asarray(update, dtype=np.float64)
    if x.shape != (params.dimension,) or not np.all(np.isfinite(x)):
        raise RingError(f"an update of shape {x.shape} (finite: {bool(np.all(np.isfinite(x)))}) for a round "
                        f"of dimension {params.dimension}")
    norm = float(np.linalg.norm(x))
    if norm > params.clip:
        x = x * (params.clip / norm)
    rounded = _round_conditionally(x * params.scale, params.l2_bound, rng)
    noisy = rounded + _skellam(params.local_variance, params.dimension, rng)
    return (noisy & ((1 << bits) - 1)).astype(np.uint32)


def centred(ring_sum: np.ndarray, bits: int) -> np.ndarray:
    """Ring elements mod 2^bits read as signed integers in [-2^(bits-1), 2^(bits-1))."""
    values = np.asarray(ring_sum, dtype=np.int64)
    return np.where(values >= 1 << (bits - 1), values - (1 << bits), values)


def decode_sum(ring_sum: np.ndarray, params: SkellamParams, bits: int) -> np.ndarray:
    """The unmasked ring sum as the (noisy) sum of the clipped updates, in model units."""
    return centred(ring_sum, bits).astype(np.float64) / params.scale


def skellam_rdp(alpha: int, l1: float, l2: float, variance: float) -> float:
    """RDP of order ``alpha`` (integer > 1) of the Skellam mechanism with central ``variance`` and
    sensitivities ``l1``, ``l2`` (integer units): Agarwal, Kairouz and Liu 2021, Theorem 3.5,
    alpha l2^2 / (2 mu) + min(((2 alpha - 1) l2^2 + 6 l1) / (4 mu^2), 3 l1 / (2 mu))."""
    if variance <= 0:
        return math.inf
    mu = variance
    return alpha * l2 * l2 / (2 * mu) + min(((2 * alpha - 1) * l2 * l2 + 6 * l1) / (4 * mu * mu), 3 * l1 / (2 * mu))


def _log_binom(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _amplified(alpha: int, q: float, rdp_at, higher: float) -> float:  # type: ignore[no-untyped-def]
    """1/(alpha-1) log sum_l C(alpha,l) (1-q)^(alpha-l) q^l e^{(l-1) rdp(l)}, with the terms l >= 3
    multiplied by e^higher, never more than the unsampled mechanism's RDP (summed in log space)."""
    plain = rdp_at(alpha)
    if q >= 1.0:
        return plain
    terms = [alpha * math.log1p(-q), math.log(alpha) + math.log(q) + (alpha - 1) * math.log1p(-q)]
    for ell in range(2, alpha + 1):
        terms.append((higher if ell >= 3 else 0.0) + _log_binom(alpha, ell) + ell * math.log(q)
                     + (alpha - ell) * math.log1p(-q) + (ell - 1) * rdp_at(ell))
    top = max(terms)
    return min((top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1), plain)


def subsampled_rdp(alpha: int, q: float, rdp_at) -> float:  # type: ignore[no-untyped-def]
    """RDP of order ``alpha`` of a mechanism (RDP ``rdp_at(j)`` at integer orders j) under Poisson
    sampling at rate q: Zhu and Wang 2019, Theorem 6 (the upper bound),
    1/(alpha-1) log[(1-q)^(alpha-1) (alpha q - q + 1) + C(alpha,2) q^2 (1-q)^(alpha-2) e^{rdp(2)}
                    + 3 sum_{l=3..alpha} C(alpha,l) q^l (1-q)^(alpha-l) e^{(l-1) rdp(l)}],
    never more than the unsampled mechanism's. (The first term is the expansion's l = 0 and 1.)"""
    return _amplified(alpha, q, rdp_at, math.log(3))


def subsampled_rdp_symmetric(alpha: int, q: float, rdp_at) -> float:  # type: ignore[no-untyped-def]
    """RDP of order ``alpha`` (integer >= 2) under Poisson sampling at rate q of a *symmetric*
    mechanism: one whose neighbouring output distributions P (with the device) and Q (without) are
    swapped by a bijective involution T of the outputs, Q(T x) = P(x), given an RDP bound
    ``rdp_at(j)`` on D_j(P || Q) at integer orders j. An additive mechanism with noise symmetric
    about 0 (Gaussian, Laplace, Skellam, discrete Gaussian) is one: T reflects about the midpoint of
    the two sums.

    With r = P/Q and M = (1 - q) Q + q P, the "remove" direction is
    B = E_Q[(1 - q + q r)^alpha] = sum_l C(alpha, l) (1 - q)^(alpha - l) q^l E_Q[r^l], exact, with
    E_Q[r^l] = exp((l - 1) D_l(P || Q)) <= exp((l - 1) rdp(l)); the "add" direction is
    A = E_Q[(1 - q + q r)^(1 - alpha)], and A <= B for every symmetric pair (docs/privacy.md,
    "Sampling amplification for symmetric mechanisms"). So this is Mironov, Talwar and Zhang's
    formula for the sampled Gaussian with the mechanism's RDP in place of the Gaussian's, and equals
    it for the Gaussian: Zhu and Wang's expansion without its factor 3. Never more than the
    unsampled mechanism's."""
    return _amplified(alpha, q, rdp_at, 0.0)


def epsilon_from_rdp(rdp: Sequence[float], delta: float, orders: Sequence[int] = ORDERS) -> float:
    """(epsilon, delta) from RDP at integer orders (Canonne, Kamath and Steinke 2020's conversion,
    as dp-accounting's RDP accountant uses)."""
    best = math.inf
    for value, alpha in zip(rdp, orders):
        if math.isfinite(value):
            best = min(best, value + math.log1p(-1 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1))
    return max(best, 0.0) if math.isfinite(best) else math.inf


def skellam_params(clip: float, noise_multiplier: float, dimension: int, devices: int) -> SkellamParams:
    """The round's public noise parameters for client-level DP-FedAvg with noise ``noise_multiplier``
    (z) added inside the ring, the same for the coordinator and every device.

    The scale, s = sqrt(``SCALE_SQUARED`` d) / C, keeps the rounding's norm inflation, and with it
    the noise's, small (see ``SCALE_SQUARED``). The released sum's variance in integer units is
    V = (z D2)^2 for D2 the rounded vectors' L2 bound; each of the ``devices`` planned into the round
    adds V / devices."""
    if devices < 1:
        raise RingError(f"a round's noise is shared among its planned devices; got {devices}")
    scale = max(math.sqrt(SCALE_SQUARED * dimension), 16.0) / clip
    provisional = SkellamParams(clip, scale, 1.0, dimension)
    return SkellamParams(clip, scale, (noise_multiplier * provisional.l2_bound) ** 2 / devices, dimension)


def round_noise(spec: DPSpec, numel: int, devices: int) -> SkellamParams:
    """One round's Skellam parameters for DP setting ``spec`` and the ``devices`` planned into it
    (the Poisson sample actually drawn): what the secure-aggregation plan carries, and what the DP
    layer tops up and accounts for."""
    return skellam_params(spec.clip, spec.noise, numel, max(devices, 1))


def ledger_round(spec: DPSpec, numel: int, q: float) -> tuple[float, float, float, float]:
    """What a round that released a sum spends, as the Skellam ledger records it: (q, V, L1, L2).
    The released sum carries Sk(V) whoever took part (the devices' shares plus the top-up)."""
    whole = skellam_params(spec.clip, spec.noise, numel, 1)  # one device's share would be all of V
    return q, whole.local_variance, whole.l1_bound, whole.l2_bound


def top_up(params: SkellamParams, planned: int, survivors: int, rng: np.random.Generator) -> np.ndarray:
    """The coordinator's share of the noise, in integer units: Sk((planned - survivors) mu_local),
    the shares of the planned devices whose noisy uploads are not in the sum, so that the released
    sum carries Sk(planned mu_local) = Sk(V) whoever dropped. ``rng`` must be unpredictable (seeded
    from the OS CSPRNG)."""
    if not 0 <= survivors <= planned:
        raise RingError(f"{survivors} survivors of {planned} planned devices")
    missing = (planned - survivors) * params.local_variance
    if missing == 0:
        return np.zeros(params.dimension, dtype=np.int64)
    return _skellam(missing, params.dimension, rng)


def released_sum(noisy_sum: np.ndarray | None, params: SkellamParams, planned: int, survivors: int,
                 rng: np.random.Generator) -> np.ndarray:
    """What a round releases, in model units, before the division by q N, with the noise's level
    the same whoever answered: the unmasked noisy sum of the ``survivors`` plus the coordinator's
    top-up for the ``planned`` devices that dropped; or, when no sum was unmasked (``None``), noise
    alone of the same variance V, drawn here (no device's data is in it), so that whether noise
    appears never depends on who took part. That noise is Skellam on the ring's lattice, as a sum's
    is: a float Gaussian would tell a noise-only round apart from a sum (privacy audit 2, N4). Both
    coordinators (the engine's DP layer and ``fedge.flower``'s) release through this."""
    if noisy_sum is None:  # all of V: the planned devices' shares together
        return _skellam(max(planned, 1) * params.local_variance, params.dimension, rng) / params.scale
    return noisy_sum + top_up(params, planned, survivors, rng) / params.scale
