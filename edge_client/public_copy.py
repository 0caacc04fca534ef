"""The node's copy of the broadcast model, for the compressed downlink (see aggregation.broadcast).

Kept in ``context.state`` with the round it belongs to. A change from the server applies only to the
copy of the round it was computed from; anything else is refused so that the node can never train
from a model that silently differs from the server's public copy (the server then sends the full
model next time).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from compression import Codec

__all__ = ["OutOfSyncError", "apply", "store"]

_MODEL = "fedge.downlink.model"
_META = "fedge.downlink.meta"


class OutOfSyncError(RuntimeError):
    """The server sent a change for a model version this node does not hold."""


def store(state: RecordDict, public: torch.Tensor, server_round: int) -> None:
    state[_MODEL] = ArrayRecord({"public": Array(public.detach().to(torch.float32).numpy())})
    state[_META] = ConfigRecord({"round": server_round})


def apply(state: RecordDict, codec: Codec, payload: bytes, base_round: int, server_round: int) -> torch.Tensor:
    """Move the stored copy of ``base_round`` by the decoded change; store and return the new copy."""
    if _MODEL not in state or _META not in state:
        raise OutOfSyncError("no public model copy on this node; the server must send the full model")
    held = int(state.config_records[_META]["round"])
    if held != base_round:
        raise OutOfSyncError(f"this node holds the model of round {held}, the change is from round {base_round}")
    public = torch.from_numpy(np.array(state.array_records[_MODEL]["public"].numpy(), dtype=np.float32))
    public += codec.decode(payload, public.numel())
    store(state, public, server_round)
    return public
