"""Encode a client's model delta through its compression memory, persisted between rounds.

The memory (error feedback's residual, or DGC's momentum and accumulation) lives in Flower's
``context.state`` (a ``RecordDict`` kept per node and run, also in the deployment engine where every
message runs in a fresh ``flwr-clientapp`` process). It is tied to the codec spec and the model size:
when either changes, it restarts from zero instead of being applied to something it does not
belong to.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from compression import Codec

__all__ = ["encode_update", "load_memory_state"]

log = logging.getLogger(__name__)

_STATE = "fedge.memory"
_META = "fedge.memory.meta"


def load_memory_state(state: RecordDict, codec: Codec, numel: int) -> dict[str, torch.Tensor] | None:
    """The stored memory tensors for this codec spec and model size, or None (start from zero)."""
    if _STATE not in state or _META not in state:
        return None
    meta = state.config_records[_META]
    if meta.get("codec") != codec.spec or meta.get("numel") != numel:
        log.info("codec or model changed (%s -> %s): compression memory reset", meta.get("codec"), codec.spec)
        return None
    record = state.array_records[_STATE]
    return {key: torch.from_numpy(np.array(array.numpy(), dtype=np.float32, copy=True))
            for key, array in record.items()}


def encode_update(
    delta: torch.Tensor,
    codec: Codec,
    state: RecordDict,
    *,
    server_round: int,
    seed: int,
    error_feedback: bool,
    generator: torch.Generator | None = None,
) -> tuple[bytes, float]:
    """Return the payload for ``delta`` (encoded with ``codec.for_round``) and the L2 norm of what
    the memory carries over to the next round."""
    wire = codec.for_round(server_round, seed)
    if not error_feedback:
        return wire.encode(delta, generator), 0.0
    numel = delta.numel()
    memory = codec.make_memory(wire, numel, load_memory_state(state, codec, numel))
    payload = memory.encode(delta, generator)
    state[_STATE] = ArrayRecord({key: Array(value.numpy()) for key, value in memory.state_dict().items()})
    state[_META] = ConfigRecord({"codec": codec.spec, "numel": numel})
    return payload, float(memory.residual.norm())
