"""Compressed gossip on the device (``train.gossip``): CHOCO-SGD with relayed messages.

The node keeps its model x_i and versioned public copies x̂_j of itself and its peers (node store
namespace ``gossip``). Per message (see ``fedge.server.algorithms.gossip``): bring the copies to the message's
version (apply the relayed q's, or take the full copies), mix x_i ← x_i + γ Σ_j W_ij (x̂_j − x̂_i),
train locally, reply q_i = Q(x_i − x̂_i). The node does not apply its own q_i yet: it comes back in
the next message only if the coordinator accepted it, so the node and its peers always apply the
same q's. The public copy is CHOCO's error memory: no separate error feedback is used.
"""

from __future__ import annotations

import time

from flwr.app import Context, Message

from fedge.aggregation.choco import consensus_step
from fedge.edge_client import local
from fedge.edge_client.public_copy import OutOfSyncError, PublicCopy
from fedge.protocol import PUBLIC_RECORD, RELAY_RECORD, ProtocolError, read_flats, read_payloads

__all__ = ["train"]

_NAMESPACE = "gossip"


def _int_list(config_value: object, what: str) -> list[int]:
    if not isinstance(config_value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                     for v in config_value):
        raise ProtocolError(f"config {what} is not a list of integers")
    return list(config_value)


def train(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    config = local.round_config(msg)
    task = local.task_of(config)
    numel = local.flat_of(task.build_model()).numel()
    position = config.integer("position", low=0)
    version = config.integer("version", low=0)
    gamma = config.number("gamma", low=0.0, high=1.0)
    peers = _int_list(config.extra.get("peers"), "peers")
    mix_peers = _int_list(config.extra.get("mix-peers"), "mix-peers")
    mix_weights = config.extra.get("mix-weights")
    if position not in peers or not set(mix_peers) <= set(peers):
        raise ProtocolError("config peers do not include this node or its mixing peers")
    if not isinstance(mix_weights, list) or len(mix_weights) != len(mix_peers) or not all(
            isinstance(w, float) and 0.0 <= w <= 1.0 for w in mix_weights):
        raise ProtocolError("config mix-weights must be one weight in [0, 1] per mixing peer")
    store = local.store(context, _NAMESPACE)
    copies = {j: PublicCopy(store.child("public"), str(j)) for j in peers}

    if PUBLIC_RECORD in msg.content.array_records:
        full = read_flats(msg.content, PUBLIC_RECORD, numel)
        if set(full) != {str(j) for j in peers}:
            raise ProtocolError(f"full public copies for {sorted(full)}, expected {sorted(peers)}")
        for j in peers:
            copies[j].set(full[str(j)], version)
    elif RELAY_RECORD in msg.content.array_records:
        relayed = read_payloads(msg.content, RELAY_RECORD)
        unknown = set(relayed) - {str(j) for j in peers}
        if unknown:
            raise ProtocolError(f"relayed payloads for nodes {sorted(unknown)} this node does not follow")
        codec = local.codec_for(config.text("relay-codec"), task)
        for j in peers:  # check every version first: apply all of them or none
            if copies[j].version != version - 1:
                raise OutOfSyncError(f"copy {j} is at version {copies[j].version}, the relay is from {version - 1}")
        for j in peers:
            if str(j) in relayed:
                copies[j].apply(codec, relayed[str(j)], version - 1, version)
            else:  # that peer sent nothing last step: its copy is unchanged everywhere
                value = copies[j].get()
                assert value is not None
                copies[j].set(value, version)
    else:
        raise ProtocolError(f"message carries neither {PUBLIC_RECORD!r} nor {RELAY_RECORD!r}")

    public = {j: copies[j].get() for j in peers}
    own = public[position]
    assert own is not None
    x = store.get_tensor("model")
    if x is None or x.numel() != numel:
        x = own.clone()  # first message of this run on this node: start from its public copy
    if mix_peers:
        x = consensus_step(x, own, public, dict(zip(mix_peers, mix_weights)), gamma)

    model = local.load_flat(task, x)
    generator = local.node_generator(config, context, "train")
    result = local.train(model, local.local_data(context, config), config, generator)
    x = local.flat_of(model)
    store.put_tensor("model", x)
    wire = local.codec_for(config.codec, task).for_round(config.round, config.seed)
    payload = wire.encode(x - own, generator)
    measure = x if config.flag("measure") else None
    return local.train_reply(msg, payload, {"num-examples": result.examples, "train-loss": result.loss, "train-seconds": result.seconds,
                                            "drift-norm": float((x - own).norm())}, started, measure=measure)
