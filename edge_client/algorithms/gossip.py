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
from fedge.compression import make_codec
from fedge.edge_client import local
from fedge.edge_client.public_copy import OutOfSyncError, PublicCopy
from fedge.protocol import PUBLIC_RECORD, RELAY_RECORD, ProtocolError, read_flats, read_payloads
from fedge.protocol.config_keys import (
    GOSSIP_GAMMA,
    GOSSIP_MEASURE,
    GOSSIP_MIX_PEERS,
    GOSSIP_MIX_WEIGHTS,
    GOSSIP_PEERS,
    GOSSIP_POSITION,
    GOSSIP_VERSION,
)
from fedge.tasks import flatten_state, tensor_sizes, unflatten_state

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
    model = task.build_model()  # the one model of this message: its layout, then its training
    template = model.state_dict()
    numel = flatten_state(template).numel()
    # the run's codec for this model; each round derives its shared seeds from it (the payloads
    # relayed here were encoded in round ``version``, this node's own upload in this round)
    codec = make_codec(config.codec).for_model(tensor_sizes(template))
    position = config.integer(GOSSIP_POSITION, low=0)
    version = config.integer(GOSSIP_VERSION, low=0)
    gamma = config.number(GOSSIP_GAMMA, low=0.0, high=1.0)
    peers = _int_list(config.extra.get(GOSSIP_PEERS), GOSSIP_PEERS)
    mix_peers = _int_list(config.extra.get(GOSSIP_MIX_PEERS), GOSSIP_MIX_PEERS)
    mix_weights = config.extra.get(GOSSIP_MIX_WEIGHTS)
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
        relay_codec = codec.for_round(version, config.seed)  # the round those payloads were encoded in
        for j in peers:  # check every version first: apply all of them or none
            if copies[j].version != version - 1:
                raise OutOfSyncError(f"copy {j} is at version {copies[j].version}, the relay is from {version - 1}")
        for j in peers:
            if str(j) in relayed:
                copies[j].apply(relay_codec, relayed[str(j)], version - 1, version)
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

    model.load_state_dict(unflatten_state(x, template))
    generator = local.node_generator(config, context, "train")
    result = local.train(model, local.local_data(context, config), config, generator,
                         device=local.node_device(context))
    x = local.flat_of(model)
    store.put_tensor("model", x)
    payload = codec.for_round(config.round, config.seed).encode(x - own, generator)
    measure = x if config.flag(GOSSIP_MEASURE) else None
    return local.train_reply(msg, payload, {"num-examples": result.examples, "train-loss": result.loss, "train-seconds": result.seconds,
                                            "drift-norm": float((x - own).norm())}, started, measure=measure)
