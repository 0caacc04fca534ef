"""Encode a client's model delta with error feedback whose residual survives between rounds.

The residual lives in Flower's ``context.state`` (a ``RecordDict`` kept per node and run, also in the
deployment engine where every message runs in a fresh ``flwr-clientapp`` process). It is tied to the
codec spec and the model size: when either changes, the residual restarts from zero instead of being
applied to something it does not belong to.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from compression import Codec, ErrorFeedback

__all__ = ["encode_update", "load_residual"]

log = logging.getLogger(__name__)

_RESIDUAL = "fedge.ef.residual"
_META = "fedge.ef.meta"


def load_residual(state: RecordDict, codec: Codec, numel: int) -> torch.Tensor | None:
    """The stored residual for this codec and model size, or None (then EF starts from zero)."""
    if _RESIDUAL not in state or _META not in state:
        return None
    meta = state.config_records[_META]
    if meta.get("codec") != codec.spec or meta.get("numel") != numel:
        log.info("codec or model changed (%s -> %s): error-feedback residual reset",
                 meta.get("codec"), codec.spec)
        return None
    residual = state.array_records[_RESIDUAL]["residual"].numpy()
    return torch.from_numpy(np.array(residual, dtype=np.float32, copy=True))


def encode_update(
    delta: torch.Tensor,
    codec: Codec,
    state: RecordDict,
    *,
    error_feedback: bool,
    generator: torch.Generator | None = None,
) -> tuple[bytes, float]:
    """Return the payload for ``delta`` and the L2 norm of the residual now carried over."""
    if not error_feedback:
        return codec.encode(delta, generator), 0.0
    numel = delta.numel()
    ef = ErrorFeedback(codec, numel, load_residual(state, codec, numel))
    payload = ef.encode(delta, generator)
    state[_RESIDUAL] = ArrayRecord({"residual": Array(ef.residual.numpy())})
    state[_META] = ConfigRecord({"codec": codec.spec, "numel": numel})
    return payload, float(ef.residual.norm())
