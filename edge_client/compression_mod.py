"""``compression_mod``: a ClientApp mod that sends the update compressed, with error feedback.

Fedge's own ClientApp lists it too: its handlers hand their flat delta over
(``edge_client.device_update``) and the mod encodes it with the round's codec, through the
handler's memory, clipped first under differential privacy. For a user's app:

The user's ``@app.train()`` body is untouched: it receives the model and returns its trained
``ArrayRecord`` as always. When the train message carries the wrapper's codec config
(``fedge.flower.compressed``), the mod replaces the reply's arrays by one Fedge payload: the update
(trained minus received, the floating-point arrays flattened in the record's order) encoded with
the codec the server asked for, through the one device-side encoder Fedge's own devices use
(``fedge.edge_client.update_encoder.encode_update``: error feedback, DGC's momentum aged over the
rounds a node missed), with its memory in the node's ``Context.state``, so it carries over to the
node's next round. A message without that config
passes through unchanged (the server is not wrapped); a model whose layout differs from what the
server described is refused with an error reply, never encoded against the wrong arrays.

With the wrapper's lattice downlink (``downlink="lattice:..."``) any message (train or evaluate)
brings a lattice change instead of the model: the mod rebuilds the model first
(``fedge.edge_client.downlink``), so the user's code gets its ``ArrayRecord`` as always. A ``tcs`` uplink
sends on the coordinates that change moved (``compression.shared_support``), which the wrapper
knows too, having sent it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fedge.compression import derive_seed, make_codec
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client import local
from fedge.edge_client.device_update import DeviceUpdate, take_update
from fedge.edge_client.downlink import DOWNLINK_NAMESPACE, held_support, receive_downlink
from fedge.edge_client.local import round_config
from fedge.edge_client.update_encoder import encode_update
from fedge.protocol.downlink import DownlinkHeader
from fedge.protocol.records import MODEL_RECORD, RAW_RECORD, UPDATE_RECORD, payload_record
from fedge.protocol.uplink_request import UplinkRequest

__all__ = ["compression_mod"]

log = logging.getLogger(__name__)

_MEMORY = "flower-uplink"  # the node store's namespace of the compression memory


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    config = msg.content.config_records.get("config")
    support = None  # the coordinates the downlink's change moved: a tcs uplink sends on them
    header = DownlinkHeader.read(config)
    if header is not None and MODEL_RECORD not in msg.content.array_records:  # the model it brings, first
        support = receive_downlink(msg, context, header)
    if not msg.metadata.message_type.startswith("train"):
        return call_next(msg, context)
    request = UplinkRequest.read(config)
    update = take_update(msg, context, call_next, "compress", request.layout if request else None,
                         wrapped=request is not None)
    if isinstance(update, DeviceUpdate):  # a Fedge handler's: the round's codec, the handler's memory and stream
        return _send_handed(msg, context, update, support)
    if isinstance(update, Message) or request is None:  # an error, or a server that is not wrapped
        return update  # type: ignore[return-value]
    reply, layout, trained, delta = update.reply, update.layout, update.trained, update.delta
    codec = make_codec(request.codec).for_model(layout.sizes())
    # the dither from (the wrapper's seed, the round, this node's partition): the same bits in every
    # run that samples the same nodes (a node without a partition id: its Flower number stands in)
    node = int(context.node_config.get("partition-id", context.node_id))
    generator = torch.Generator().manual_seed(derive_seed(request.seed, request.round, node, purpose="dither"))
    payload, _ = encode_update(delta, codec, NodeStore(context.state, _MEMORY), server_round=request.round,
                               seed=request.seed, error_feedback=True, generator=generator, support=support)
    content = RecordDict({name: record for name, record in reply.content.items() if name != MODEL_RECORD})
    content[UPDATE_RECORD] = payload_record(payload)
    raw = ArrayRecord({name: trained[name] for name, _, _ in layout.entries
                       if name not in {n for n, _, _ in layout.floats}})
    if len(raw):
        content[RAW_RECORD] = raw
    reply.content = content
    return reply


def _send_handed(msg: Message, context: Context, update: DeviceUpdate, support: np.ndarray | None) -> Message:
    """A Fedge handler's update, bounded and encoded with the round's codec through its memory
    (``support``: what this message's downlink change moved; else what the last one moved)."""
    config = round_config(msg)
    update.bound(config)
    if support is None:
        support = held_support(NodeStore(context.state, DOWNLINK_NAMESPACE))
    payload, residual = local.encode(update.delta, config, update.sizes, NodeStore(context.state, update.memory),
                                     update.generator, support=support)
    return update.reply(msg, payload, {"num-examples": update.examples, **update.metrics, "residual-norm": residual,
                                       "update-norm": float(update.delta.norm())})
