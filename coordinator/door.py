"""The door every reply goes through, in every driver: Fedge's engine (its synchronous and
asynchronous loops, federated evaluation) and the Flower-app wrappers (``layered``, ``FedBuff``).

Whether a reply is used or why it is not is decided here once, so the two coordinators cannot drift:
a node that did not answer, a Flower error reply and a device's typed refusal (declined by its
owner's policy, out of sync, ...) each become their :class:`Failure`; anything else goes to the
driver's ``consume``, whose refusal (:class:`Rejected`, a payload or protocol error) becomes one too.
What ``consume`` does with the reply (the layers' part of the door, ``protocol.layer.LayerStack.through``,
then the algorithm or the strategy) is the driver's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flwr.app import Message

from fedge.compression import PayloadError
from fedge.protocol.failures import Failure, FailureKind, Rejected
from fedge.protocol.records import ProtocolError
from fedge.protocol.refusals import read_refusal
from fedge.coordinator.step import Missing, Reply

__all__ = ["REFUSES", "door"]

log = logging.getLogger(__name__)

#: what ``consume`` raises to refuse a reply (the reason is kept, the reply left out), in both
#: coordinators; anything else is a bug and propagates (a layout mismatch is a ProtocolError)
REFUSES: tuple[type[Exception], ...] = (Rejected, PayloadError, ProtocolError)


def door(number: int, item: Message | Missing, consume: Callable[[Reply], None], started: int | None = None,
         what: str = "update") -> Failure | None:
    """Pass ``item`` (a reply of step or version ``number``, or a :class:`Missing` for a node that did
    not answer) through the door: None when ``consume`` used it, else the :class:`Failure` that says
    why not. ``started``: the version its message was built from (asynchronous drivers)."""
    if isinstance(item, Missing):
        return Failure(item.node, FailureKind.TIMEOUT, item.reason)
    node = item.metadata.src_node_id
    if item.has_error():
        return Failure(node, FailureKind.CLIENT_ERROR, f"client error {item.error.code}: {item.error.reason}")
    try:
        refusal = read_refusal(item.content)
        if refusal is not None:
            log.log(logging.INFO if refusal[0].declined else logging.WARNING, "round %d: node %d refused: %s (%s)",
                    number, node, refusal[1], refusal[0])
            return Failure(node, refusal[0], refusal[1])
        consume(Reply(node, item.content, started=started))
    except REFUSES as err:
        log.warning("round %d: rejected %s from node %d: %s", number, what, node, err)
        return Rejected.failure(node, err)
    return None
