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


STORAGE = ("fp32", "fp16", "int8")
_BLOCK = 4096
_SCALE = ".scale"


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

    def get_tensors(self, key: str) -> dict[str, torch.Tensor] | None:
        """The tensors stored under ``key`` as float32 (copies, safe to modify), or None; fp16 and
        int8 storage (:meth:`put_tensors`) are expanded back."""
        full = self._key(key)
        if full not in self._state.array_records:
            return None
        arrays = self._state.array_records[full]
        out = {}
        for name, array in arrays.items():
            if name.endswith(_SCALE):
                continue
            values = np.asarray(array.numpy())
            if values.dtype == np.int8:
                scales = np.asarray(arrays[name + _SCALE].numpy(), dtype=np.float32)
                blocks = np.zeros(scales.size * _BLOCK, dtype=np.float32)
                blocks[: values.size] = values
                values = (blocks.reshape(-1, _BLOCK) * scales[:, None]).reshape(-1)[: values.size]
            out[name] = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
        return out

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], storage: str = "fp32") -> None:
        """Store float tensors as ``fp32``, ``fp16`` or ``int8`` (blocks of 4,096 values with one
        fp32 scale each, rounded to nearest): compact state for many clients in one process, at the
        cost of the rounding error (what it does to accuracy is measured in docs/results.md)."""
        if storage not in STORAGE:
            raise ValueError(f"storage must be one of {STORAGE}, got {storage!r}")
        arrays: dict[str, Array] = {}
        for name, t in tensors.items():
            flat = t.detach().to(torch.float32).contiguous()
            if storage == "fp16":
                arrays[name] = Array(flat.to(torch.float16).numpy())
            elif storage == "int8":
                values = flat.reshape(-1)
                padded = torch.zeros(-(-values.numel() // _BLOCK) * _BLOCK)
                padded[: values.numel()] = values
                blocks = padded.reshape(-1, _BLOCK)
                scales = blocks.abs().amax(dim=1) / 127.0
                safe = torch.where(scales > 0, scales, torch.ones_like(scales))
                levels = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)
                arrays[name] = Array(levels[: values.numel()].numpy())
                arrays[name + _SCALE] = Array(scales.numpy())
            else:
                arrays[name] = Array(flat.numpy())
        self._state[self._key(key)] = ArrayRecord(arrays)

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

    def keys(self) -> list[str]:
        """Keys of this namespace (and its children), without the prefix."""
        head = self._key("")
        return sorted(k[len(head):] for k in self._state if k.startswith(head))
