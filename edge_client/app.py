"""The Fedge ClientApp: local training on private data, compressed updates with error feedback.

Runs unchanged under Flower's simulation engine (Ray) and its deployment engine (a SuperNode per
device). The coordinator sends everything a round needs in the message's ConfigRecord, so a client
never trusts a local copy of the run settings; the node's own config says which data is its own.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from compression import make_codec
from compression.protocol import (
    CONFIG_RECORD,
    DOWNLINK_RECORD,
    METRICS_RECORD,
    MODEL_RECORD,
    PAYLOAD_KEY,
    PAYLOAD_STYPE,
    UPDATE_RECORD,
)
from edge_client import public_copy
from edge_client.trainer import train_local
from edge_client.update_encoder import encode_update
from tasks import TensorData, evaluate, flatten_state, make_task, tensor_sizes, unflatten_state

__all__ = ["app"]

log = logging.getLogger(__name__)

app = ClientApp()


def _local_data(context: Context, config: ConfigRecord) -> TensorData:
    node = context.node_config
    try:
        partition_id = int(node["partition-id"])
        num_partitions = int(node["num-partitions"])
    except KeyError as err:
        raise ValueError(
            f"node config lacks {err}; start the SuperNode with "
            "--node-config 'partition-id=I num-partitions=N'"
        ) from None
    task = make_task(str(config["task"]))
    return task.partition(partition_id, num_partitions, str(config["partitioning"]))


def _seed(config: ConfigRecord, context: Context) -> int:
    """A per-(run seed, round, partition) seed: reproducible, different for every client and round."""
    words = [int(config["seed"]), int(config["round"]), int(context.node_config.get("partition-id", 0))]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> 1)


def _global_model(msg: Message, config: ConfigRecord) -> torch.nn.Module:
    model = make_task(str(config["task"])).build_model()
    model.load_state_dict(msg.content.array_records[MODEL_RECORD].to_torch_state_dict(), strict=True)
    return model


def _training_start(msg: Message, config: ConfigRecord, context: Context) -> torch.nn.Module:
    """The model to train from: the full model the server sent, or (compressed downlink) the
    node's public copy moved by the encoded change the server sent."""
    downlink = str(config.get("downlink-codec", "none"))
    if MODEL_RECORD in msg.content.array_records:
        model = _global_model(msg, config)
        if downlink != "none":
            public_copy.store(context.state, flatten_state(model.state_dict()), int(config["round"]))
        return model
    model = make_task(str(config["task"])).build_model()
    array = msg.content.array_records[DOWNLINK_RECORD][PAYLOAD_KEY]
    codec = make_codec(downlink).for_model(tensor_sizes(model.state_dict()))
    public = public_copy.apply(context.state, codec, array.data, int(config["base-round"]), int(config["round"]))
    model.load_state_dict(unflatten_state(public, model.state_dict()))
    return model


_FAULTS = ("truncate", "bitflip", "garbage", "hang")


def _inject_fault(payload: bytes, context: Context) -> bytes:
    """Chaos testing: a node started with ``--node-config "... fault='truncate'"`` corrupts its
    updates so operators (and our integration tests) can watch the coordinator reject them."""
    fault = context.node_config.get("fault")
    if not fault:
        return payload
    if fault not in _FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(_FAULTS)}")
    log.warning("fault injection %r on purpose (node config 'fault')", fault)
    if fault == "hang":  # a device that goes silent mid-round: the coordinator's timeout must cope
        time.sleep(24 * 3600)
    if fault == "truncate":
        return payload[: len(payload) // 2]
    if fault == "bitflip":
        return payload[:-1] + bytes([payload[-1] ^ 0x10])
    return b"\x00" * len(payload)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on the local partition and reply with the encoded ``local - global`` delta."""
    started = time.perf_counter()
    config = msg.content.config_records[CONFIG_RECORD]
    data = _local_data(context, config)
    model = _training_start(msg, config, context)
    global_flat = flatten_state(model.state_dict())
    generator = torch.Generator().manual_seed(_seed(config, context))

    result = train_local(
        model,
        data,
        epochs=int(config["local-epochs"]),
        lr=float(config["lr"]),
        batch_size=int(config["batch-size"]),
        momentum=float(config["momentum"]),
        prox_mu=float(config["prox-mu"]),
        generator=generator,
    )
    delta = flatten_state(model.state_dict()) - global_flat
    codec = make_codec(str(config["codec"])).for_model(tensor_sizes(model.state_dict()))
    payload, residual_norm = encode_update(
        delta, codec, context.state, server_round=int(config["round"]), seed=int(config["seed"]),
        error_feedback=bool(config["error-feedback"]), generator=generator,
    )
    payload = _inject_fault(payload, context)
    update = ArrayRecord(
        {PAYLOAD_KEY: Array(dtype="uint8", shape=(len(payload),), stype=PAYLOAD_STYPE, data=payload)}
    )
    metrics = MetricRecord(
        {
            "num-examples": result.examples,
            "train-loss": result.loss,
            "payload-bytes": len(payload),
            "residual-norm": residual_norm,
            "update-norm": float(delta.norm()),
            "seconds": time.perf_counter() - started,
        }
    )
    return Message(RecordDict({UPDATE_RECORD: update, METRICS_RECORD: metrics}), reply_to=msg)


@app.evaluate()
def evaluate_global(msg: Message, context: Context) -> Message:
    """Evaluate the received global model on this client's local data (no training)."""
    config = msg.content.config_records[CONFIG_RECORD]
    data = _local_data(context, config)
    loss, accuracy = evaluate(_global_model(msg, config), data)
    metrics = MetricRecord({"num-examples": len(data), "loss": loss, "accuracy": accuracy})
    return Message(RecordDict({METRICS_RECORD: metrics}), reply_to=msg)
