"""Compressed downlink: the coordinator sends the change since the model a client already holds.

The server keeps a public copy ``x_hat`` of the model, which is what every up-to-date client holds.
Each round it encodes ``q = C(x - x_hat)`` once, and every client that holds last round's copy
receives only ``q`` and applies ``x_hat += D(q)``. The server applies the same step. What ``q`` did not
carry stays in ``x - x_hat`` and is sent in a later round: this is error feedback on the server, so
the copies never drift (the same public-copy idea as CHOCO-SGD, Koloskova et al. 2019).

A client the server does not know to be current gets the full ``x_hat``: one that missed a round,
one that just joined, or any client after a coordinator restart (client state does not survive
one). The server tracks only which round each client last synchronised to: O(model + clients).
"""

from __future__ import annotations

import torch

from fedge.compression import Codec

__all__ = ["Broadcast"]


class Broadcast:
    def __init__(self, codec: Codec, params: torch.Tensor) -> None:
        self.codec = codec
        self.public = params.detach().clone().to(torch.float32)  # x_hat
        self.synced: dict[int, int] = {}  # node id -> round whose public copy it holds
        self.round = 0
        self.delta: bytes | None = None  # this round's q, for the up-to-date clients

    def advance(self, params: torch.Tensor, server_round: int, generator: torch.Generator | None = None) -> None:
        """Encode this round's change and move the public copy by exactly what was sent."""
        payload = self.codec.encode(params - self.public, generator)
        self.public.add_(self.codec.decode(payload, self.public.numel()))
        self.delta = payload
        self.round = server_round

    def is_current(self, node: int) -> bool:
        """True when ``node`` holds the previous round's public copy, so ``delta`` suffices."""
        return self.synced.get(node) == self.round - 1

    def confirm(self, node: int) -> None:
        """``node`` replied to this round's message: it now holds this round's public copy."""
        self.synced[node] = self.round

    def forget(self, node: int) -> None:
        """``node`` did not reply (or failed): send it the full model next time."""
        self.synced.pop(node, None)
