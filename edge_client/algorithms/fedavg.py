"""FedAvg / FedProx on the device: train from the global model, send ``local - global``; EASGD's
elastic step when the message names the coupling (``fedge.edge_client.elastic_mod.ElasticNode``).

Receives ``train`` messages (Flower's default train action). The model comes through the device's
downlink layer and the update leaves through its upload layer (``edge_client.layers``: clipping,
masking or encoding), so this handler is only the local step. :func:`make_train` builds the same
handler around a change of the round's config: a plugin algorithm's device side in one line
(``examples/plugins/decaying_fedavg.py``), with every layer included.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Context, Message, MetricRecord, RecordDict

from fedge.edge_client import local
from fedge.edge_client.elastic_mod import ElasticNode
from fedge.edge_client.layers import start_model, upload, uses_device_layers
from fedge.protocol import METRICS_RECORD, MODEL_RECORD, ProtocolError, read_state_dict
from fedge.protocol.config_keys import EASGD_ALPHA, PROX_MU
from fedge.protocol.round_config import RoundConfig
from fedge.protocol.secagg import SECAGG_RECORD
from fedge.tasks import evaluate as evaluate_model

__all__ = ["evaluate", "make_train", "train"]

_ELASTIC = "easgd"  # the node store namespace of an EASGD node's own model and compression memory


def make_train(adjust: Callable[[RoundConfig], RoundConfig] | None = None,
               namespace: str = "fedavg") -> Callable[[Message, Context], Message]:
    """FedAvg's device handler; ``adjust`` rewrites the round's config before training (a decayed
    learning rate, say), ``namespace`` is where the node keeps its compression memory."""

    @uses_device_layers
    def train(msg: Message, context: Context) -> Message:
        """Train on the local partition and reply with the ``local - global`` delta (EASGD: the
        elastic difference of the node's own model, when the message names the coupling)."""
        started = time.perf_counter()
        config = local.round_config(msg)
        task = local.task_of(config)
        elastic = (ElasticNode(local.store(context, _ELASTIC), config.number(EASGD_ALPHA, low=0.0, high=1.0))
                   if EASGD_ALPHA in config.extra else None)
        data, held_out = local.local_parts(context, config)  # one read of the node's data
        model = task.build_model()  # the one model of this message: its layout, the start, the training
        center = start_model(msg, config, context, task, model)
        start = elastic.own(center) if elastic is not None else center
        local.load_flat(task, start, model)
        generator = local.node_generator(config, context, "train")
        trained = adjust(config) if adjust is not None else config
        result = local.train(model, data, trained, generator, prox_mu=config.number(PROX_MU, low=0.0),
                             device=local.node_device(context))
        # FedNova's coordinator normalises by the local steps (fedge.aggregation.fednova)
        metrics = {"train-loss": result.loss, "train-seconds": result.seconds, "local-steps": result.steps}
        if elastic is None:
            return upload(msg, context, config, task, local.flat_of(model) - start, examples=result.examples,
                          memory=local.store(context, namespace), generator=generator, started=started,
                          metrics=metrics, model=model)
        delta, kept, metrics["center-distance"] = elastic.step(local.flat_of(model), center)
        if SECAGG_RECORD not in msg.content.config_records:  # masked rounds report nothing in clear
            # The node's own model measured here (the coordinator never sees x_i): on the node's held-out
            # part when the run keeps one, else on the task's central split when the device has it.
            held_out = held_out if held_out is not None else task.test_data()
            if held_out is not None:
                own = local.load_flat(task, kept, model)
                metrics["local-score"] = float(evaluate_model(own, held_out, task)[task.primary_metric])
        return upload(msg, context, config, task, delta, examples=result.examples, memory=elastic.store,
                      generator=generator, started=started, weighted=False, metrics=metrics, model=model)

    return train


train = make_train()


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
