"""``secure_mod``: the device's side of :func:`fedge.flower.secure`, as a ClientApp mod, and of
Fedge's own secure rounds (its ClientApp lists it too: a handler's handed-over update is masked
with the handler's memory and stream, weighted by its example count).

A train message with the ``secagg`` record is one of the protocol's stages. The key exchange
(advertise, share) and the unmasking are answered by the mod itself, with Fedge's device code
(``fedge.edge_client.secure_aggregation``: identity key and peer pins kept in the node's
``Context.state``, and in ``state-dir`` when the node config names one); the user's ``@app.train()``
body is not called for them. For the masked round the mod calls the user's body unchanged, takes
its update (trained minus received arrays, the floating-point arrays flattened in the record's
order), and replies with only the masked upload: the update quantized on the round's shared grid,
weighted by the reply's own example count inside the sum, with error feedback in the node's state.
The reply says nothing in clear about the device's data: ``num-examples`` 1, no loss. A message
without the record passes through (the server is not wrapped), unless the node's config requires
secure aggregation (``require-secure-aggregation``, ``fedge.edge_client.privacy_policy``): then a
train message without it, and any evaluate message, is refused before the user's code runs.
"""

from __future__ import annotations

import logging
import math
import os

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fedge.edge_client.device_update import DeviceUpdate, take_update, train_reply
from fedge.edge_client.local import round_config
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.privacy_policy import check_privacy_policy
from fedge.edge_client.secure_aggregation import masked_update, query
from fedge.protocol.layout import LayoutError
from fedge.protocol.config_keys import WEIGHT_KEY
from fedge.protocol.records import UPDATE_RECORD, payload_record
from fedge.protocol.secagg import SECAGG_RECORD, secure_stage

__all__ = ["secure_mod"]

log = logging.getLogger(__name__)

_MEMORY = "fedge.flower.secagg"  # the node store's namespace for the error-feedback residual


def secure_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    check_privacy_policy(msg, context)  # a node that requires secure aggregation refuses a round without it
    if secure_stage(msg) is not None:  # advertise, share, consistency, unmask: the protocol's own exchanges
        return query(msg, context)
    if SECAGG_RECORD not in msg.content.config_records or not msg.metadata.message_type.startswith("train"):
        return call_next(msg, context)
    update = take_update(msg, context, call_next, "mask")
    if isinstance(update, Message):  # the body answered with an error: passed on as it is
        return update
    if isinstance(update, DeviceUpdate):  # a Fedge handler's: its memory and stream, the round's error feedback
        config = round_config(msg)
        update.bound(config)
        payload, _ = masked_update(msg, context, update.delta, update.examples if update.weighted else 1,
                                   NodeStore(context.state, update.memory), update.generator,
                                   error_feedback=config.error_feedback)
        seconds = {"train-seconds": update.metrics["train-seconds"]} if "train-seconds" in update.metrics else {}
        return train_reply(msg, payload, {"num-examples": 1, **seconds}, update.started)
    reply = update.reply
    examples = _examples(reply, str(msg.content.config_records.get("config", {}).get(WEIGHT_KEY, "")))
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    memory = NodeStore(context.state, _MEMORY)
    payload, residual = masked_update(msg, context, update.delta, examples, memory, generator)
    log.debug("secure round: %d masked bytes, residual norm %.4g", len(payload), residual)
    reply.content = RecordDict({UPDATE_RECORD: payload_record(payload), "metrics": MetricRecord({"num-examples": 1})})
    return reply


def _examples(reply: Message, key: str) -> int:
    """The update's weight inside the sum: the reply's ``key`` metric (a positive count), or 1 when
    the strategy weighs every update the same (no key)."""
    if not key:
        return 1
    metrics = next(iter(reply.content.metric_records.values()), MetricRecord())
    value = metrics.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value >= 1):
        raise LayoutError(f"no positive {key!r} in the train reply's metrics to weight the update by")
    return int(value)
