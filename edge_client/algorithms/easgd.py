"""Elastic averaging on the device (``train.easgd``): the node keeps its own model x_i.

Per round: x_i (or, the first time, the center) trains for the round's local epochs; the node
sends δ_i = α(x_i − x̃) encoded with error feedback and keeps x_i ← x_i − δ_i (see ``fedge.server.algorithms.easgd``).
The center arrives through the device's downlink layer and δ_i leaves through its upload layer
(``edge_client.layers``: masked under secure aggregation, encoded otherwise).
"""

from __future__ import annotations

import time

from flwr.app import Context, Message

from fedge.aggregation.elastic import elastic_difference
from fedge.edge_client import local
from fedge.edge_client.layers import start_model, upload, uses_device_layers
from fedge.protocol.config_keys import EASGD_ALPHA
from fedge.protocol.secagg import SECAGG_RECORD
from fedge.tasks import evaluate

__all__ = ["train"]

_NAMESPACE = "easgd"


@uses_device_layers
def train(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    config = local.round_config(msg)
    alpha = config.number(EASGD_ALPHA, low=0.0, high=1.0)
    task = local.task_of(config)
    model = task.build_model()  # the one model of this message
    center = start_model(msg, config, context, task, model)
    store = local.store(context, _NAMESPACE)
    x = store.get_tensor("local")
    if x is None or x.numel() != center.numel():
        x = center.clone()  # first round this node takes part in
    data, held_out = local.local_parts(context, config)  # one read of the node's data
    local.load_flat(task, x, model)
    generator = local.node_generator(config, context, "train")
    result = local.train(model, data, config, generator, device=local.node_device(context))
    delta, x, distance = elastic_difference(local.flat_of(model), center, alpha)
    store.put_tensor("local", x)
    measured = {}
    if SECAGG_RECORD not in msg.content.config_records:  # masked rounds report nothing in clear
        # The node's own model measured here (the coordinator never sees x_i): on the node's held-out
        # part when the run keeps one, else on the task's central split when the device has it.
        held_out = held_out if held_out is not None else task.test_data()
        if held_out is not None:
            measured["local-score"] = float(evaluate(local.load_flat(task, x, model), held_out,
                                                     task)[task.primary_metric])
    return upload(msg, context, config, task, delta, examples=result.examples, memory=store, generator=generator,
                  started=started, weighted=False, model=model,
                  metrics={"train-loss": result.loss, "train-seconds": result.seconds, "center-distance": distance,
                           **measured})
