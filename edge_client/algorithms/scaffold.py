"""SCAFFOLD on the device: FedAvg's local step with every step corrected by ``c - c_i``, and the
change of the device's control variate sent beside the update (``fedge.edge_client.control_variate``,
which a Flower app's ``scaffold_mod`` keeps the same way).

The model comes through the device's downlink layer and ``y - x`` leaves through its upload layer
(the run's codec and error feedback), exactly as FedAvg's; the reply's ``CONTROL_RECORD`` carries
``dc_i``. Option II of the paper needs the local step count and rate, which this handler knows.
"""

from __future__ import annotations

import time

from flwr.app import Context, Message

from fedge.edge_client import local
from fedge.edge_client.algorithms.fedavg import evaluate
from fedge.edge_client.control_variate import ControlVariate
from fedge.edge_client.layers import start_model, upload, uses_device_layers
from fedge.protocol import CONTROL_RECORD, ProtocolError
from fedge.protocol.secagg import SECAGG_RECORD

__all__ = ["evaluate", "train"]


@uses_device_layers
def train(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    if SECAGG_RECORD in msg.content.config_records:  # dc_i, sent in clear, would reveal the masked update
        raise ProtocolError("scaffold's control change is a function of the update: it cannot run under secure "
                            "aggregation")
    config = local.round_config(msg)
    task = local.task_of(config)
    data = local.local_data(context, config)
    model = task.build_model()
    start = start_model(msg, config, context, task, model)
    local.load_flat(task, start, model)
    control = ControlVariate(msg, local.store(context, "scaffold"), start.numel())
    correction = control.by_parameter(model)
    generator = local.node_generator(config, context, "train")
    result = local.train(model, data, config, generator, correction=correction, device=local.node_device(context))
    delta = local.flat_of(model) - start
    reply = upload(msg, context, config, task, delta, examples=result.examples, memory=local.store(context, "fedavg"),
                   generator=generator, started=started,
                   metrics={"train-loss": result.loss, "train-seconds": result.seconds, "local-steps": result.steps},
                   model=model)
    # its own stream: the update's encoding (in compression_mod) continues the training's
    reply.content[CONTROL_RECORD] = control.reply(delta, result.steps, config.lr, server_round=config.round,
                                                  seed=config.seed,
                                                  generator=local.node_generator(config, context, "control"))
    return reply
