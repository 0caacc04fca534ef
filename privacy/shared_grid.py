"""Quantization on a grid every device shares, so that summed levels mean something.

QSGD scales each device's levels by that device's own norm: the sum of two devices' levels is then
meaningless, and the coordinator cannot add masked QSGD payloads. Here every device clips each
coordinate to the same range [-c, c] and rounds stochastically (unbiased) onto the same 2^b levels;
the coordinator turns the summed levels back into the sum of the clipped values with one affine map.

Weighting (FedAvg weights by examples) travels as its own masked coordinates: a device scales its
update by ``w / w_cap`` (its example count, capped) before quantizing, and sends ``w`` as base-2^b
digits. The coordinator divides the unmasked sum of scaled updates by the unmasked sum of weights,
which is exactly the example-weighted mean, without learning any one device's weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedge.privacy.errors import RingError

__all__ = ["SharedGrid"]


@dataclass(frozen=True)
class SharedGrid:
    """``bits`` levels per coordinate over [-clip, clip]; weights up to ``weight_cap`` examples."""

    bits: int
    clip: float
    weight_cap: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 16:
            raise RingError(f"shared-grid bits must be in [1, 16], got {self.bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise RingError(f"the clipping range must be a positive finite number, got {self.clip}")
        if self.weight_cap < 1:
            raise RingError(f"weight_cap must be >= 1, got {self.weight_cap}")

    @property
    def top(self) -> int:
        """The highest level, 2^b - 1."""
        return (1 << self.bits) - 1

    @property
    def weight_digits(self) -> int:
        """How many base-2^b coordinates hold a weight up to ``weight_cap``."""
        return max(1, math.ceil(math.log2(self.weight_cap + 1) / self.bits))

    def quantize(self, update: np.ndarray, weight: int, rng: np.random.Generator) -> np.ndarray:
        """Levels (uint32) of ``update * min(weight, cap) / cap`` followed by the weight's digits.

        Stochastic rounding makes each level an unbiased estimate of its clipped value.
        """
        update = np.asarray(update, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(update)):
            raise ValueError("the update holds non-finite values")
        capped = min(max(int(weight), 0), self.weight_cap)
        scaled = np.clip(update * (capped / self.weight_cap), -self.clip, self.clip)
        position = (scaled + self.clip) * (self.top / (2 * self.clip))
        levels = np.floor(position + rng.random(position.shape))
        levels = np.clip(levels, 0, self.top).astype(np.uint32)
        return np.concatenate([levels, self._digits(capped)])

    def _digits(self, weight: int) -> np.ndarray:
        digits = np.empty(self.weight_digits, dtype=np.uint32)
        for index in range(self.weight_digits):
            digits[index] = (weight >> (index * self.bits)) & self.top
        return digits

    def decode_sum(self, level_sum: np.ndarray, summands: int) -> tuple[np.ndarray, int]:
        """From the exact sum of ``summands`` devices' levels: (sum of scaled clipped updates, sum of weights)."""
        level_sum = np.asarray(level_sum, dtype=np.float64)
        values, digits = level_sum[: -self.weight_digits], level_sum[-self.weight_digits:]
        total = values * (2 * self.clip / self.top) - summands * self.clip
        return total, self.weight_sum(digits)

    def weight_sum(self, digit_sums: np.ndarray) -> int:
        """The summed weights from the summed weight digits (base 2^b)."""
        return sum(int(d) << (i * self.bits) for i, d in enumerate(digit_sums))

    def weighted_mean(self, level_sum: np.ndarray, summands: int) -> tuple[np.ndarray, int]:
        """The example-weighted mean of the devices' (clipped) updates (zeros when no weight arrived)
        and their summed weight."""
        total, weight_sum = self.decode_sum(level_sum, summands)
        return (total * (self.weight_cap / weight_sum) if weight_sum > 0 else np.zeros_like(total)), weight_sum
