"""Error feedback: the memory that makes biased (or very noisy) codecs converge.

Seide et al. 2014; Stich, Cordonnier, Jaggi NeurIPS 2018; Karimireddy et al. ICML 2019::

    p = g + e;   c = C(p);   send c;   e <- p - D(c)

so that ``sum_t D(c_t) + e_T == sum_t g_t``: compression error is delayed, never lost. The residual is
an explicit tensor the caller persists (the edge client keeps it in Flower's ``context.state``).

The convergence proofs need a *contractive* codec, ``E|C(x) - x|^2 <= (1 - delta)|x|^2``. Unbiased but
noisy codecs are not: 4-bit QSGD with the paper's L2 bucket norm has a relative squared error of ~1.6
on Gaussian data, and with error feedback its residual feeds the noise back and grows (measured on
digits: 85.0% instead of 96.4%). :func:`relative_error` measures a codec so callers can warn.
"""

from __future__ import annotations

import torch

from fedge.compression import kernels
from fedge.compression.codec import Codec, as_flat_float32

__all__ = ["ErrorFeedback", "relative_error"]


class ErrorFeedback:
    """Wrap ``codec`` with a residual of ``numel`` float32 elements."""

    def __init__(self, codec: Codec, numel: int, residual: torch.Tensor | None = None) -> None:
        if residual is None:
            residual = torch.zeros(numel, dtype=torch.float32)
        residual = as_flat_float32(residual)
        if residual.numel() != numel:
            raise ValueError(f"residual has {residual.numel()} elements, expected {numel}")
        self.codec = codec
        self.numel = numel
        self.residual = residual

    def encode(self, update: torch.Tensor, generator: torch.Generator | None = None) -> bytes:
        """Encode ``update + residual`` and keep what the payload did not carry as the new residual."""
        flat = as_flat_float32(update)
        if flat.numel() != self.numel:
            raise ValueError(f"update has {flat.numel()} elements, expected {self.numel}")
        corrected = flat + self.residual
        payload = self.codec.encode(corrected, generator)
        self.residual = corrected.sub_(self.codec.decode(payload, self.numel))
        return payload

    def reset(self) -> None:
        self.residual.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"residual": self.residual}


def relative_error(codec: Codec, numel: int, seed: int = 0) -> float:
    """``|D(C(x)) - x|^2 / |x|^2`` for one Gaussian ``x`` of ``numel`` elements (>= 1: not contractive).

    Measured on the torch reference path: a statistic of the codec, not of one implementation, and
    the CLI's checks and a coordinator that never encodes need not load numba (about a second of
    CPU at the start of every run) for it."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    with kernels.reference_path():
        err = codec.decode(codec.encode(x, gen), numel) - x
    return float(err.pow(2).sum() / x.pow(2).sum())
