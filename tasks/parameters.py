"""Model state <-> one flat float32 vector, the unit that codecs and aggregators work on.

The order is the model's ``state_dict`` order, identical on every process that builds the same
task, so a flat update from a client lines up with the server's model element by element.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

__all__ = ["flatten_state", "model_digest", "numel_of", "tensor_sizes", "unflatten_state"]


def _float_items(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for k, v in state.items() if torch.is_floating_point(v)]


def tensor_sizes(state: dict[str, torch.Tensor]) -> list[int]:
    """Element counts of the floating-point tensors, in flattening order (per-tensor codec policies)."""
    return [v.numel() for _, v in _float_items(state)]


def numel_of(state: dict[str, torch.Tensor]) -> int:
    """Number of floating-point elements (integer buffers such as step counters are not trained)."""
    return sum(v.numel() for _, v in _float_items(state))


def flatten_state(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """Concatenate every floating-point tensor of ``state`` into one float32 vector."""
    items = _float_items(state)
    if not items:
        return torch.zeros(0)
    return torch.cat([v.detach().reshape(-1).to(torch.float32) for _, v in items])


def model_digest(flat: torch.Tensor) -> str:
    """A short fingerprint of a flat model (sha256 of its float32 little-endian bytes, 16 hex digits):
    two users who ran the same seed and settings compare it to know they trained the same model."""
    data = flat.detach().reshape(-1).to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def unflatten_state(vector: torch.Tensor, template: dict[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    """Split ``vector`` back into tensors shaped like ``template`` (non-float entries are copied)."""
    expected = numel_of(template)
    if vector.numel() != expected:
        raise ValueError(f"vector has {vector.numel()} elements, the model has {expected}")
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    offset = 0
    for key, value in template.items():
        if torch.is_floating_point(value):
            n = value.numel()
            out[key] = vector[offset : offset + n].view(value.shape).to(value.dtype).clone()
            offset += n
        else:
            out[key] = value.clone()
    return out
