"""``compression_mod``: a ClientApp mod that sends the update compressed, with error feedback.

The user's ``@app.train()`` body is untouched: it receives the model and returns its trained
``ArrayRecord`` as always. When the train message carries the wrapper's codec config
(``fedge.flower.strategy``), the mod replaces the reply's arrays by one Fedge payload: the update
(trained minus received, the floating-point arrays flattened in the record's order) encoded with
the codec the server asked for. The error-feedback memory (what compression held back) lives in the
node's ``Context.state``, so it carries over to the node's next round. A message without that config
passes through unchanged (the server is not wrapped); a model whose layout differs from what the
server described is refused with an error reply, never encoded against the wrong arrays.

With the wrapper's lattice downlink (``downlink="lattice:..."``) any message (train or evaluate)
brings a lattice change instead of the model: the mod rebuilds the model first
(``fedge.flower.receive``), so the user's code gets its ``ArrayRecord`` as always. A ``tcs`` uplink
sends on the coordinates that change moved (``compression.shared_support``), which the wrapper
knows too, having sent it.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fedge.compression import make_codec
from fedge.flower.layout import Layout
from fedge.flower.receive import receive_downlink
from fedge.protocol.config_keys import CODEC_KEY, DOWNLINK_CODEC, LAYOUT_KEY, ROUND_KEY, SEED_KEY
from fedge.protocol.records import MODEL_RECORD, RAW_RECORD, UPDATE_RECORD, payload_record
from fedge.flower.user_update import train_user_update

__all__ = ["compression_mod"]

log = logging.getLogger(__name__)

_MEMORY = "fedge.flower.memory"  # Context.state: the residual, and what it was built for
_MEMORY_META = "fedge.flower.memory-meta"


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    config = msg.content.config_records.get("config")
    support = None  # the coordinates the downlink's change moved: a tcs uplink sends on them
    if config is not None and DOWNLINK_CODEC in config:  # a lattice downlink: the model it brings, first
        support = receive_downlink(msg, context)
    if not msg.metadata.message_type.startswith("train") or config is None or CODEC_KEY not in config:
        return call_next(msg, context)
    update = train_user_update(msg, context, call_next, "compress", digest=str(config[LAYOUT_KEY]))
    if isinstance(update, Message):  # the user's body answered with an error: passed on as it is
        return update
    reply, layout, trained, delta = update.reply, update.layout, update.trained, update.delta
    spec, server_round, seed = str(config[CODEC_KEY]), int(config[ROUND_KEY]), int(config[SEED_KEY])
    wire = make_codec(spec).for_model(layout.sizes()).for_round(server_round, seed).with_support(support)
    memory = wire.make_memory(wire, layout.numel, _load_memory(context, spec, layout))
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    payload = memory.encode(delta, generator)
    _save_memory(context, spec, layout, memory.state_dict())
    content = RecordDict({name: record for name, record in reply.content.items() if name != MODEL_RECORD})
    content[UPDATE_RECORD] = payload_record(payload)
    raw = ArrayRecord({name: trained[name] for name, _, _ in layout.entries
                       if name not in {n for n, _, _ in layout.floats}})
    if len(raw):
        content[RAW_RECORD] = raw
    reply.content = content
    return reply


def _load_memory(context: Context, spec: str, layout: Layout) -> dict[str, torch.Tensor] | None:
    meta = context.state.config_records.get(_MEMORY_META)
    record = context.state.array_records.get(_MEMORY)
    if meta is None or record is None or meta.get("codec") != spec or meta.get("layout") != layout.digest:
        return None  # first round, or another codec or model: start with no residual
    return {name: torch.from_numpy(np.array(array.numpy(), copy=True)) for name, array in record.items()}


def _save_memory(context: Context, spec: str, layout: Layout, state: dict[str, torch.Tensor]) -> None:
    context.state[_MEMORY] = ArrayRecord({name: Array(t.detach().cpu().numpy()) for name, t in state.items()})
    context.state[_MEMORY_META] = ConfigRecord({"codec": spec, "layout": layout.digest})
