"""FedAvg / FedProx on the device: train from the global model, send ``local - global``.

Receives ``train`` messages (Flower's default train action). The model comes in full (``arrays``)
or, with the lattice downlink, as what brings the node's versioned copy of it up to date.
"""

from __future__ import annotations

import time

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict

from fedge.edge_client import local
from fedge.edge_client.downlink import received_model
from fedge.edge_client.secure_aggregation import masked_update
from fedge.protocol import METRICS_RECORD, MODEL_RECORD, ProtocolError, read_state_dict
from fedge.protocol.round_config import RoundConfig
from fedge.protocol.secagg import SECAGG_RECORD
from fedge.tasks import evaluate as evaluate_model

__all__ = ["evaluate", "train"]

_NAMESPACE = "fedavg"
_DOWNLINK = "downlink"


def _training_start(msg: Message, config: RoundConfig, context: Context) -> torch.nn.Module:
    """The model to train from: the full model the server sent, or the node's versioned copy of it
    brought up to date by what the server sent (lattice downlink, ``edge_client.downlink``)."""
    task = local.task_of(config)
    return local.load_flat(task, received_model(msg, config, local.store(context, _DOWNLINK), task))


def train(msg: Message, context: Context) -> Message:
    """Train on the local partition and reply with the encoded ``local - global`` delta."""
    started = time.perf_counter()
    config = local.round_config(msg)
    data = local.local_data(context, config)
    model = _training_start(msg, config, context)
    start = local.flat_of(model)
    generator = local.node_generator(config, context, "train")
    result = local.train(model, data, config, generator, prox_mu=config.number("prox-mu", low=0.0))
    delta = local.flat_of(model) - start
    privacy: dict[str, float] = {}
    if "dp-clip" in config.extra:  # differential privacy: this device's contribution is bounded here
        clip = config.number("dp-clip", low=0.0)
        norm = float(delta.norm())
        privacy["dp-fitted"] = 1.0 if norm <= clip else 0.0  # adaptive clipping's bit (counted with noise)
        delta = delta * (clip / norm) if norm > clip > 0 else delta
    memory = local.store(context, _NAMESPACE)
    if SECAGG_RECORD in msg.content.config_records:  # secure aggregation: a masked upload, nothing in clear
        payload, _ = masked_update(msg, context, delta, result.examples, memory, generator,
                                   error_feedback=config.error_feedback)
        # nothing about the update in clear (its residual's norm would be): only the masked upload
        return local.train_reply(msg, payload, {"num-examples": 1, "train-seconds": result.seconds}, started)
    payload, residual = local.encode(delta, config, local.task_of(config), memory, generator)
    return local.train_reply(msg, payload, {"num-examples": result.examples, "train-loss": result.loss, "train-seconds": result.seconds,
                                            "residual-norm": residual, "update-norm": float(delta.norm()), **privacy},
                             started)


def evaluate(msg: Message, context: Context) -> Message:
    """Federated evaluation, for every algorithm: the received model (global, center or average)
    on this node's held-out part, never trained on. Replies with the example count and the task's
    loss and metrics (``fedge.server.engine.evaluation`` combines them weighted by examples)."""
    config = local.round_config(msg)
    data = local.local_heldout(context, config)
    if data is None:
        raise ProtocolError("an evaluate message needs a run that keeps a local held-out part (holdout > 0)")
    task = local.task_of(config)
    model = task.build_model()
    model.load_state_dict(read_state_dict(msg.content, MODEL_RECORD, model.state_dict()), strict=True)
    metrics = MetricRecord({"num-examples": len(data), **evaluate_model(model, data, task)})
    return Message(RecordDict({METRICS_RECORD: metrics}), reply_to=msg)
