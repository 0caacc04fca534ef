"""The device's answer to the coordinator's roll call (``fedge.protocol.roster``): its partition id.

Nothing of the device's data or model is read: the answer is the node config's ``partition-id``
(after ``leaf_devices_mod`` has mapped a leaf's simulated node to the device it stands for), which
the coordinator uses only to order nodes the same way in every run of one seed.
"""

from __future__ import annotations

from flwr.app import Context, Message

from fedge.protocol.roster import roster_answer

__all__ = ["answer_roster"]


def answer_roster(msg: Message, context: Context) -> Message:
    return Message(roster_answer(dict(context.node_config)), reply_to=msg)
