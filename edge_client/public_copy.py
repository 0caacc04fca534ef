"""A node's copy of a public model, moved only by encoded changes it receives (CHOCO's x_hat).

Used by gossip: the node's copies of its own and its neighbours' public models (the coordinator's
model reaches devices through the lattice downlink instead, ``edge_client.downlink``). Each copy lives in the node store with the version (round) it belongs to. A change applies
only to the copy of the version it was computed from; anything else raises :class:`OutOfSyncError`
so that a node can never train from a model that silently differs from the one its peers hold (the
coordinator then sends the full copy next time).
"""

from __future__ import annotations

import torch

from fedge.compression import Codec
from fedge.edge_client.node_store import NodeStore
from fedge.protocol.refusals import OutOfSyncError

__all__ = ["OutOfSyncError", "PublicCopy"]


class PublicCopy:
    """The copy named ``key`` in ``store``."""

    def __init__(self, store: NodeStore, key: str) -> None:
        self.store = store
        self.key = key

    @property
    def version(self) -> int | None:
        meta = self.store.get_meta(f"{self.key}.meta")
        return None if meta is None else int(meta["version"])

    def get(self) -> torch.Tensor | None:
        return self.store.get_tensor(self.key)

    def set(self, value: torch.Tensor, version: int) -> None:
        self.store.put_tensor(self.key, value.detach().to(torch.float32))
        self.store.put_meta(f"{self.key}.meta", {"version": int(version)})

    def apply(self, codec: Codec, payload: bytes, base: int, version: int) -> torch.Tensor:
        """Move the copy of version ``base`` by the decoded change; store it as ``version``."""
        held = self.version
        current = self.get()
        if held is None or current is None:
            raise OutOfSyncError(f"no copy of {self.key!r} on this node; the coordinator must send it in full")
        if held != base:
            raise OutOfSyncError(f"this node holds {self.key!r} of version {held}, the change is from {base}")
        current += codec.decode(payload, current.numel())
        self.set(current, version)
        return current
