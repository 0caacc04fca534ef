"""A device takes part in a root round once, whichever leaf it is connected to, as a Flower mod.

Beyond one SuperLink (``fedge local-cluster --leaves``, ``fedge.server.leaf``) every leaf steps its
own devices once per root round, and the root adds up the leaves' steps. A device that moves to
another leaf while a root round runs (its connection dropped, its ``fedge-edge join`` pointed at
another leaf) could be asked by both: its update would count twice in that round, once in each
leaf's partial sum, and neither leaf nor the root could take it out again (a leaf's sum is
compressed, or masked under secure aggregation).

Only the device knows it was asked twice, so the device keeps the rule: each leaf stamps its train
messages with the root round it serves and its own index (``fedge.root-round``,
``fedge.root-leaf``, ``fedge.protocol.leaf.RootOrigin``); the device remembers the last root round
it trained for and through which leaf (the last :data:`WINDOW` root rounds: a leaf still serving an
older root round, late, is declined too; remembering only the last one let it train the device a
second time for that round, privacy audit 3, F8), in its node state (with ``state-dir``, on its disk through
``fedge.edge_client.persistent_state``, so the memory moves with the device to its new leaf), and
declines a train message of that root round from another leaf with a typed ``counted-elsewhere``
refusal, which the leaf counts as declined, not failed. The same leaf may ask it again in that root
round (several leaf steps per root round). Messages without the stamps (one tier) pass through.
"""

from __future__ import annotations

import logging

from flwr.app import Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable

from fedge.edge_client.node_store import NodeStore
from fedge.protocol import CONFIG_RECORD
from fedge.protocol.config_keys import ROOT_LEAF, ROOT_ROUND
from fedge.protocol.refusals import BadConfigRefusal, CountedElsewhereRefusal
from fedge.protocol.secagg import secure_stage

__all__ = ["WINDOW", "counted_once_mod"]

log = logging.getLogger(__name__)

_NAMESPACE = "root-round"  # the node store's namespace: {"rounds": ["<root run>/<round>", ...], "leaves": [...]}

#: root rounds a device remembers (a root round outlives its leaves' steps by far less)
WINDOW = 64


def counted_once_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    config = msg.content.config_records.get(CONFIG_RECORD)
    if (msg.metadata.message_type != MessageType.TRAIN or config is None or ROOT_ROUND not in config
            or secure_stage(msg) is not None):
        return call_next(msg, context)
    root_round, leaf = config[ROOT_ROUND], config.get(ROOT_LEAF)
    if not isinstance(root_round, str) or not isinstance(leaf, int) or isinstance(leaf, bool) or leaf < 0:
        raise BadConfigRefusal(f"{ROOT_ROUND} must be text and {ROOT_LEAF} a leaf index, got {root_round!r}, {leaf!r}")
    store = NodeStore(context.state, _NAMESPACE)
    held = store.get_meta("last") or {}
    rounds = list(zip(held.get("rounds", []), held.get("leaves", []), strict=False))
    if "round" in held:  # the one-round memory of before 2026-12-07
        rounds.append((held["round"], held.get("leaf")))
    where = dict(rounds)
    if root_round in where and where[root_round] != leaf:
        raise CountedElsewhereRefusal(f"this device took part in root round {root_round} through leaf "
                                      f"{where[root_round]}; leaf {leaf} asked it again (it moved during the round)")
    reply = call_next(msg, context)
    if not reply.has_error() and root_round not in where:  # its update is in this leaf's step
        rounds = [*rounds, (root_round, leaf)][-WINDOW:]
        store.put_meta("last", {"rounds": [r for r, _ in rounds], "leaves": [int(w) for _, w in rounds]})
    return reply
