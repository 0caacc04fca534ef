"""Encode a client's update through its compression memory, persisted between rounds.

The memory (error feedback's residual, or DGC's momentum and accumulation) lives in the node store
(Flower's ``context.state``, kept per node and run, also on the deployment engine where every
message runs in a fresh ``flwr-clientapp`` process). It is tied to the codec spec and the update
size: when either changes, it restarts from zero instead of being applied to something it does not
belong to. Each algorithm passes its own store namespace, so a node's EASGD memory and its gossip
memory never mix.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from fedge.compression import Codec
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.resources import timed

__all__ = ["encode_update", "load_memory_state"]

log = logging.getLogger(__name__)


def load_memory_state(store: NodeStore, codec: Codec, numel: int) -> dict[str, torch.Tensor] | None:
    """The stored memory tensors for this codec spec and update size, or None (start from zero)."""
    meta = store.get_meta("memory.meta")
    tensors = store.get_tensors("memory")
    if meta is None or tensors is None:
        return None
    if meta.get("codec") != codec.spec or meta.get("numel") != numel:
        log.info("codec or model changed (%s -> %s): compression memory reset", meta.get("codec"), codec.spec)
        return None
    return tensors


@timed("encode")
def encode_update(
    delta: torch.Tensor,
    codec: Codec,
    store: NodeStore,
    *,
    server_round: int,
    seed: int,
    error_feedback: bool,
    generator: torch.Generator | None = None,
    storage: str = "fp32",
    support: np.ndarray | None = None,
) -> tuple[bytes, float]:
    """Return the payload for ``delta`` (encoded with ``codec.for_round``) and the L2 norm of what
    the memory carries over to the next round. ``storage`` is how the memory is kept between rounds
    (``fp32``, ``fp16`` or ``int8``: see :meth:`NodeStore.put_tensors`); ``support``: the
    coordinates the last downlink change moved, which a ``tcs`` codec sends on."""
    wire = codec.for_round(server_round, seed)
    if wire.shares_support:
        wire = wire.with_support(support)
    if not error_feedback:
        return wire.encode(delta, generator), 0.0
    numel = delta.numel()
    memory = codec.make_memory(wire, numel, load_memory_state(store, codec, numel))
    meta = store.get_meta("memory.meta") or {}
    last = meta.get("round")
    if isinstance(last, int) and 0 < last < server_round and hasattr(memory, "age"):
        memory.age(server_round - last)  # partial participation: rounds since this client last sent
    payload = memory.encode(delta, generator)
    store.put_tensors("memory", memory.state_dict(), storage)
    store.put_meta("memory.meta", {"codec": codec.spec, "numel": numel, "round": int(server_round)})
    return payload, float(memory.residual.norm())
