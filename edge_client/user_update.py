"""The update a user's ``@app.train()`` body made: what both ClientApp mods send, each in its own way.

A mod hands the message to the user's body unchanged and takes the difference between the arrays
the body returns and the arrays the message brought (the floating-point arrays, flattened in the
record's order). Both records must be there, and of the layout the server described when it
described one: an update is never taken against the wrong arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.protocol.layout import Layout, LayoutError
from fedge.protocol.records import MODEL_RECORD

__all__ = ["UserUpdate", "train_user_update"]


@dataclass
class UserUpdate:
    reply: Message  # the user's own reply (its records are the mod's to replace)
    layout: Layout
    received: ArrayRecord
    trained: ArrayRecord
    delta: torch.Tensor  # trained minus received, flat, float32


def train_user_update(msg: Message, context: Context, call_next: ClientAppCallable, purpose: str,
                      digest: str | None = None) -> UserUpdate | Message:
    """Run the user's body on ``msg``; its reply as it is when it is an error reply, else the update.
    ``purpose`` names the mod's use in errors ("compress", "mask"); ``digest``: the layout the server
    described, refused when the model differs."""
    received = msg.content.array_records.get(MODEL_RECORD)
    if received is None:
        raise LayoutError(f"a train message to {purpose} needs the model in its {MODEL_RECORD!r} ArrayRecord")
    layout = Layout(received)
    if digest is not None and layout.digest != digest:
        raise LayoutError(f"the model's layout {layout.digest} is not the one the server described ({digest})")
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    trained = reply.content.array_records.get(MODEL_RECORD)
    if trained is None:
        raise LayoutError(f"the train reply has no {MODEL_RECORD!r} ArrayRecord to {purpose}")
    delta = torch.from_numpy(layout.flatten(trained) - layout.flatten(received)).to(torch.float32)
    return UserUpdate(reply, layout, received, trained, delta)
