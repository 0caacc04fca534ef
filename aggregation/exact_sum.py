"""Exact sums: the same bits whatever order the terms arrive in.

Why: a float32 running sum rounds after every reply, so the same replies added in another order give
another last bit. Replies reach a coordinator in the order the devices happen to finish; with
sparsification, error feedback and a quantized downlink one last bit changes which coordinates are
sent next round, and two runs of one seed part (seven points of accuracy apart after 60 rounds on
digits). Integer addition is associative, so the coordinator adds in fixed point instead.

:class:`ExactSum` holds ``sum_k w_k x_k`` per coordinate on the grid ``2**-54`` in two integer limbs:
``hi`` (int64, multiples of ``2**-24``) and ``lo`` (int32, the 30 bits below, always in
``[0, 2**30)``; a carry moves into ``hi`` after every term). Each term ``w * x`` is formed in float64
and rounded down onto the grid, which depends on that term alone, so the sum of any set of terms is
one number whatever their order. 12 bytes a coordinate (a float32 sum held 4, a float64 one 8).

Range: one term's magnitude must stay below ``2**36`` (6.9e10) and the step's terms together below
``2**38``; beyond that :class:`AccumulationRangeError` refuses the term and leaves the sum as it was
(an update that large is broken; the update guard's norm bound, when set, refuses it long before).
Resolution: ``2**-54`` (5.6e-17) per term, below float32's rounding of any value above ``1e-9``
(whose float32 spacing is 1.1e-16).

:class:`ExactScalar` is the same promise for the scalars a step sums (losses, weights, squared
norms): it keeps the terms and adds them with :func:`math.fsum`, which rounds once, correctly.
"""

from __future__ import annotations

import math

import torch

from fedge.compression.errors import PayloadError

__all__ = ["AccumulationRangeError", "ExactScalar", "ExactSum", "check_term"]

#: ``hi`` counts multiples of ``2**-HI_BITS``; ``lo`` holds ``LO_BITS`` more bits below them
HI_BITS = 24
LO_BITS = 30
_HI_SCALE = float(2**HI_BITS)
_LO_SCALE = float(2**LO_BITS)
_LO_MASK = 2**LO_BITS - 1
#: the largest magnitude of one term; the budget of all terms together, in ``hi`` units (2**38 in value)
TERM_LIMIT = 2.0**36
_BUDGET = 2**62
#: coordinates converted at a time: the float64 temporaries stay at a few hundred KB
CHUNK = 1 << 16


class AccumulationRangeError(PayloadError):
    """A term too large (or not finite) for the exact sum; the sum is left as it was. A
    :class:`~fedge.compression.PayloadError`: every coordinator's door refuses the reply that
    carried it, records why, and carries on."""


class ExactSum:
    """``sum_k w_k x_k`` over vectors of ``numel`` values, exact on the grid ``2**-54``."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.hi = torch.zeros(numel, dtype=torch.int64)
        self.lo = torch.zeros(numel, dtype=torch.int32)
        self.count = 0
        self._budget = 0  # an upper bound of max |hi| in hi units: nothing overflows below 2**62
        self._scratch: _Scratch | None = None

    @classmethod
    def from_float32(cls, held: torch.Tensor, weight: float) -> ExactSum:
        """The exact sum of one term ``weight * held``, built in ``held``'s own memory: its float32
        storage becomes the ``lo`` limb (a streaming mean holds its first reply as float32 and only
        needs the limbs when a second one comes, so the limbs never coexist with that copy)."""
        flat = held.reshape(-1)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            raise ValueError("from_float32 takes a contiguous float32 vector")
        units = check_term(flat, weight)
        out = cls.__new__(cls)
        out.numel, out.count, out._budget, out._scratch = flat.numel(), 1, units, None
        out.hi = torch.zeros(flat.numel(), dtype=torch.int64)
        lo = flat.view(torch.int32)  # the same bytes: each chunk is read before it is written
        scratch = out._buffers()
        for start in range(0, flat.numel(), CHUNK):
            stop = min(start + CHUNK, flat.numel())
            scratch.add(flat[start:stop], weight, out.hi[start:stop], lo[start:stop], fresh=True)
        out.lo = lo
        return out

    def add(self, vector: torch.Tensor, weight: float = 1.0) -> None:
        """Add ``weight * vector``; :class:`AccumulationRangeError` (nothing added) when a value is
        not finite or the term would leave the exact range."""
        flat = vector.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"vector has {flat.numel()} elements, expected {self.numel}")
        units = check_term(flat, weight)
        if self._budget + units > _BUDGET:
            raise AccumulationRangeError(
                "the step's terms would exceed the exact sum's range (2**38 in all); refused")
        scratch = self._buffers()
        for start in range(0, self.numel, CHUNK):
            stop = min(start + CHUNK, self.numel)
            scratch.add(flat[start:stop], weight, self.hi[start:stop], self.lo[start:stop])
        self._budget += units
        self.count += 1

    def value(self, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
        """The sum times ``scale`` (``1 / total weight`` gives the mean), computed in float64 from the
        exact limbs and rounded once to ``dtype``."""
        out = torch.empty(self.numel, dtype=dtype)
        wide = self._buffers().wide
        for start in range(0, self.numel, CHUNK):
            stop = min(start + CHUNK, self.numel)
            part = wide[: stop - start]
            part.copy_(self.lo[start:stop]).mul_(1 / _LO_SCALE).add_(self.hi[start:stop])
            out[start:stop] = part.mul_(scale / _HI_SCALE)
        return out

    def nbytes(self) -> int:
        return self.hi.element_size() * self.numel + self.lo.element_size() * self.numel

    def _buffers(self) -> _Scratch:
        if self._scratch is None:
            self._scratch = _Scratch(min(CHUNK, max(self.numel, 1)))
        return self._scratch


class _Scratch:
    """One chunk's temporaries, allocated once per sum and reused for every chunk of every term:
    fresh allocations of this size per chunk made the heap grow by megabytes over a hundred replies."""

    def __init__(self, size: int) -> None:
        self.wide = torch.empty(size, dtype=torch.float64)
        self.high = torch.empty(size, dtype=torch.float64)
        self.units = torch.empty(size, dtype=torch.int64)
        self.bits = torch.empty(size, dtype=torch.int32)

    def add(self, chunk: torch.Tensor, weight: float, hi: torch.Tensor, lo: torch.Tensor,
            fresh: bool = False) -> None:
        """Add one chunk of ``weight * x`` onto the grid: ``floor(w x 2**24)`` to ``hi`` and the next
        30 bits (a floor too) to ``lo``, then carry. Each part depends on the term alone, and
        ``x * (w * 2**24)`` is ``(x * w) * 2**24`` exactly, one rounding. ``fresh``: ``hi``/``lo``
        hold nothing yet (``lo`` may be the chunk's own float32 bytes, read here first)."""
        m = chunk.numel()
        wide, high, units, bits = self.wide[:m], self.high[:m], self.units[:m], self.bits[:m]
        wide.copy_(chunk).mul_(weight * _HI_SCALE)
        torch.floor(wide, out=high)
        wide.sub_(high).mul_(_LO_SCALE).floor_()
        units.copy_(high)
        if fresh:
            hi.copy_(units)
            lo.copy_(wide)
            return
        hi.add_(units)
        bits.copy_(wide)
        lo.add_(bits)
        torch.bitwise_right_shift(lo, LO_BITS, out=bits)  # lo < 2**31: one carry at most
        hi.add_(bits)
        lo.bitwise_and_(_LO_MASK)


def check_term(flat: torch.Tensor, weight: float) -> int:
    """The term's largest magnitude in ``hi`` units (rounded up); :class:`AccumulationRangeError`
    when a value is not finite or beyond ``TERM_LIMIT``."""
    if flat.numel() == 0:
        return 0
    low, high = (float(v) for v in torch.aminmax(flat))  # no model-sized temporary, as abs() would be
    peak = max(-low, high) * abs(weight)
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(peak)):
        raise AccumulationRangeError("a value of the term is not finite")
    if peak >= TERM_LIMIT:
        raise AccumulationRangeError(f"a value of the term ({peak:.3g}) is beyond the exact sum's range "
                                     f"({TERM_LIMIT:.3g})")
    return math.ceil(peak * _HI_SCALE) + 1


class ExactScalar:
    """A sum of floats that is the same whatever the order of its terms (``math.fsum``)."""

    def __init__(self) -> None:
        self._terms: list[float] = []

    def add(self, value: float) -> None:
        self._terms.append(float(value))

    @property
    def terms(self) -> tuple[float, ...]:
        return tuple(self._terms)

    @property
    def count(self) -> int:
        return len(self._terms)

    @property
    def value(self) -> float:
        return math.fsum(self._terms)

    def __float__(self) -> float:
        return self.value
