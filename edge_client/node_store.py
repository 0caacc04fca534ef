"""Namespaced, typed access to a node's persistent state (Flower's ``context.state``).

``context.state`` is one flat ``RecordDict`` per node and run; it survives between messages, also on
the deployment engine where every message runs in a fresh ``flwr-clientapp`` process. A node that
runs EASGD or gossip keeps several model copies in it (its local model, the public copies of its
neighbours, a compression memory per codec). :class:`NodeStore` gives each owner its own namespace
(``fedge/<namespace>/<key>``) so those copies never collide, stores tensors as flat float32 arrays
and small metadata as ConfigRecords, and reads back exactly what was written (bit for bit: CHOCO's
public copies must agree between a node and its neighbours).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

__all__ = ["NodeStore"]

_PREFIX = "fedge"


class NodeStore:
    def __init__(self, state: RecordDict, namespace: str) -> None:
        if not namespace.strip("/") or not all(namespace.strip("/").split("/")):
            raise ValueError(f"bad namespace {namespace!r}")
        self._state = state
        self.namespace = namespace.strip("/")

    def child(self, name: str) -> NodeStore:
        return NodeStore(self._state, f"{self.namespace}/{name}")

    def _key(self, key: str) -> str:
        return f"{_PREFIX}/{self.namespace}/{key}"

    def has(self, key: str) -> bool:
        return self._key(key) in self._state

    def get_tensors(self, key: str) -> dict[str, torch.Tensor] | None:
        """The tensors stored under ``key`` (copies, safe to modify), or None."""
        full = self._key(key)
        if full not in self._state.array_records:
            return None
        return {
            name: torch.from_numpy(np.array(array.numpy(), dtype=np.float32, copy=True))
            for name, array in self._state.array_records[full].items()
        }

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        self._state[self._key(key)] = ArrayRecord(
            {name: Array(t.detach().to(torch.float32).contiguous().numpy()) for name, t in tensors.items()}
        )

    def get_tensor(self, key: str) -> torch.Tensor | None:
        tensors = self.get_tensors(key)
        return None if tensors is None else tensors["value"]

    def put_tensor(self, key: str, tensor: torch.Tensor) -> None:
        self.put_tensors(key, {"value": tensor})

    def get_bytes(self, key: str) -> bytes | None:
        """Raw bytes stored with :meth:`put_bytes` (an encoded, compact form of some state), or None."""
        full = self._key(key)
        if full not in self._state.array_records:
            return None
        return bytes(np.asarray(self._state.array_records[full]["bytes"].numpy(), dtype=np.uint8).tobytes())

    def put_bytes(self, key: str, data: bytes) -> None:
        self._state[self._key(key)] = ArrayRecord({"bytes": Array(np.frombuffer(data, dtype=np.uint8).copy())})

    def get_meta(self, key: str) -> dict[str, Any] | None:
        full = self._key(key)
        if full not in self._state.config_records:
            return None
        return dict(self._state.config_records[full])

    def put_meta(self, key: str, values: dict[str, Any]) -> None:
        self._state[self._key(key)] = ConfigRecord(values)

    def delete(self, key: str) -> None:
        full = self._key(key)
        if full in self._state:
            del self._state[full]

    def keys(self) -> list[str]:
        """Keys of this namespace (and its children), without the prefix."""
        head = self._key("")
        return sorted(k[len(head):] for k in self._state if k.startswith(head))
