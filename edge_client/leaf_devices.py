"""A simulated leaf's node trains as the device it stands for, as a Flower mod.

Beyond one SuperLink a leaf may run its devices under Flower's Simulation Engine (``fedge
local-cluster --leaves L --leaf-engine simulation``). Flower gives each simulated node
``partition-id = j`` of ``num-partitions = n``, its own numbering; a deployed leaf's SuperNode has
the device's partition of the whole federation instead. With the run setting ``leaf-devices``
(``fedge.protocol.leaf_devices``) this mod rewrites the node's config, once, to the device's
partition of N before anything reads it (its data, its seeds, its slowdown or fault, the root round
it is counted in), and keeps Flower's own number as ``leaf-node``. Every node of a run without the
setting passes through untouched.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.protocol.leaf_devices import parse_leaf_devices

__all__ = ["LEAF_NODE", "leaf_devices_mod"]

#: the node config key that keeps a simulated leaf node's own Flower number once it is mapped
LEAF_NODE = "leaf-node"


def leaf_devices_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    spec = str(context.run_config.get("leaf-devices", "") or "")
    if spec and LEAF_NODE not in context.node_config:
        leaf = parse_leaf_devices(spec)
        node = int(context.node_config["partition-id"])
        # Flower keeps the context between the node's messages: mapped once, marked as mapped
        context.node_config[LEAF_NODE] = node
        context.node_config["partition-id"] = leaf.device(node)
        context.node_config["num-partitions"] = leaf.devices
    return call_next(msg, context)
