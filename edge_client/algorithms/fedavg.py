"""FedAvg / FedProx on the device: train from the global model, send ``local - global`` (EASGD:
``elastic_mod`` hands it the node's own model instead and takes the elastic step from what it trained).

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
from fedge.edge_client.layers import start_model, upload, uses_device_layers
from fedge.protocol import METRICS_RECORD, MODEL_RECORD, ProtocolError, read_state_dict
from fedge.protocol.config_keys import PROX_MU
from fedge.protocol.round_config import RoundConfig
from fedge.tasks import evaluate as evaluate_model

__all__ = ["evaluate", "make_train", "train"]


def make_train(adjust: Callable[[RoundConfig], RoundConfig] | None = None,
               namespace: str = "fedavg") -> Callable[[Message, Context], Message]:
    """FedAvg's device handler; ``adjust`` rewrites the round's config before training (a decayed
    learning rate, say), ``namespace`` is where the node keeps its compression memory."""

    @uses_device_layers
    def train(msg: Message, context: Context) -> Message:
        """Train on the local partition and reply with the ``local - global`` delta (EASGD's
        ``elastic_mod`` hands it the node's own model and takes the elastic step from it)."""
        started = time.perf_counter()
        config = local.round_config(msg)
        task = local.task_of(config)
        parts = local.local_parts(context, config)  # elastic_mod measures on the held-out part
        model = task.build_model()  # the one model of this message: its layout, the start, the training
        start = start_model(msg, config, context, task, model)
        generator = local.node_generator(config, context, "train")
        trained = adjust(config) if adjust is not None else config
        result = local.train(model, parts[0], trained, generator, prox_mu=config.number(PROX_MU, low=0.0),
                             device=local.node_device(context))
        # FedNova's coordinator normalises by the local steps (fedge.aggregation.fednova)
        metrics = {"train-loss": result.loss, "train-seconds": result.seconds, "local-steps": result.steps}
        return upload(msg, context, config, task, local.flat_of(model) - start, examples=result.examples,
                      memory=local.store(context, namespace), generator=generator, started=started,
                      metrics=metrics, model=model, parts=parts)

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
