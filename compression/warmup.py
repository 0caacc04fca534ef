"""Compile the fused kernels once, before a process forks the workers that will use them.

numba compiles (or loads from its on-disk cache) each kernel the first time it is called, in every
process: a fresh process paid that on its first encode. A warm device process
(``fedge.edge_client.warm_executor``) calls :func:`warm_up` once; every child it forks then finds
the kernels already compiled in memory. It exercises each built-in codec on a small tensor, encode
and decode, with the settings runs use most.
"""

from __future__ import annotations

import logging

import torch

from fedge.compression.registry import make_codec

__all__ = ["WARM_SPECS", "warm_up"]

log = logging.getLogger(__name__)

#: one spec per kernel specialisation runs commonly reach (qsgd compiles one kernel per bit width)
WARM_SPECS = (
    "qsgd:bits=4,bucket=512,norm=max", "qsgd:bits=2", "qsgd:bits=8", "qsgd:bits=4,norm=l2", "terngrad",
    "sign", "onebit", "topk", "dgc", "threshold", "randk", "grid", "fp16", "bf16", "fp32",
)


def warm_up(specs: tuple[str, ...] = WARM_SPECS, numel: int = 4096) -> list[str]:
    """Encode and decode a ``numel`` tensor with every spec; the specs that failed (logged, skipped)."""
    failed = []
    x = torch.linspace(-1.0, 1.0, numel)
    generator = torch.Generator().manual_seed(0)
    for spec in specs:
        try:
            wire = make_codec(spec).for_round(1, 0)
            wire.decode(wire.encode(x, generator), numel)
        except Exception as err:  # noqa: BLE001 - a codec that cannot warm up still works when used
            log.debug("warm-up of %s failed: %s", spec, err)
            failed.append(spec)
    return failed
