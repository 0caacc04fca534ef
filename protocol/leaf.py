"""What a root's bridge node and its leaf coordinator agree on: one leaf step, asked and answered.

A leaf coordinator (``fedge.server.leaf``) runs Fedge's engine over its own devices on its own
SuperLink. The root sees it as one node: a bridge SuperNode whose ClientApp (``fedge.edge_client.bridge``)
hands each root train message's model to the leaf through a :class:`LeafChannel` and sends the
root what comes back as a device sends its update. What comes back is the change of the leaf's
model over its step (its devices' weighted mean update, for FedAvg), the weight of that step (the
examples behind it) and how many devices' updates are in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["LeafChannel", "LeafResult"]


@dataclass(frozen=True)
class LeafResult:
    """One leaf step, as the bridge reports it to the root."""

    #: the leaf's model after its step(s) minus the model the root sent (flat, float32)
    delta: torch.Tensor
    #: the step's total weight (its devices' example counts; 0 when no update was used)
    weight: float
    #: devices whose updates are in it
    count: int
    #: the devices' mean training loss, when they reported one
    train_loss: float | None = None


class LeafChannel(Protocol):
    """How a bridge asks its leaf for a step: in one process a leaf coordinator itself; across
    processes a channel on the leaf's host."""

    def step(self, root_round: int, model: torch.Tensor) -> LeafResult: ...
