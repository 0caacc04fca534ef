"""SCAFFOLD on the device: train from the global model with every step corrected by ``c - c_i``,
send ``y - x`` and the change of the device's control variate (``fedge.aggregation.scaffold``).

The device's ``c_i`` lives in its node store (namespace ``scaffold``), kept across rounds as its
error-feedback memory is; a device that has never taken part starts from zero, as in the paper.
The server's ``c`` arrives in ``CONTROL_RECORD``, encoded with the codec the message's config
names. The model comes through the device's downlink layer and ``y - x`` leaves through its upload
layer (the run's codec and error feedback), exactly as FedAvg's; ``dc_i`` rides beside it in the
update record, encoded with the run's codec through an error-feedback memory of its own, so that
over rounds the coordinator's sum of the changes tracks the devices' exact ones.
"""

from __future__ import annotations

import time

import torch
from flwr.app import Context, Message

from fedge.aggregation.scaffold import control_step
from fedge.compression import PayloadError, make_codec
from fedge.edge_client import local
from fedge.edge_client.algorithms.fedavg import evaluate
from fedge.edge_client.layers import start_model, upload, uses_device_layers
from fedge.protocol import (
    CONTROL_KEY,
    CONTROL_RECORD,
    UPDATE_RECORD,
    ProtocolError,
    payload_array,
    read_payload,
)
from fedge.protocol.config_keys import SCAFFOLD_CONTROL_CODEC
from fedge.tasks import unflatten_state


__all__ = ["evaluate", "server_control", "train"]

_STATE = "scaffold"  # the node store's namespace of c_i
_CONTROL_MEMORY = "scaffold-control"  # the error-feedback memory of the dc_i uploads


def server_control(msg: Message, numel: int, codec_spec: str) -> torch.Tensor:
    """The server's ``c`` the message carries, decoded and checked (:class:`ProtocolError`)."""
    try:
        return make_codec(codec_spec).decode(read_payload(msg.content, CONTROL_RECORD), numel)
    except PayloadError as err:
        raise ProtocolError(f"scaffold: the server's control variate: {err}") from None


@uses_device_layers
def train(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    config = local.round_config(msg)
    task = local.task_of(config)
    data = local.local_data(context, config)
    model = task.build_model()
    start = start_model(msg, config, context, task, model)
    local.load_flat(task, start, model)
    server = server_control(msg, start.numel(), config.text(SCAFFOLD_CONTROL_CODEC))
    state = local.store(context, _STATE)
    own = state.get_tensor("control")
    if own is None or own.numel() != start.numel():
        own = torch.zeros_like(start)  # a device's first round (or a new model): c_i = 0
    parameters = dict(model.named_parameters())
    correction = {name: value for name, value in unflatten_state(server - own, model.state_dict()).items()
                  if name in parameters}
    generator = local.node_generator(config, context, "train")
    result = local.train(model, data, config, generator, correction=correction, device=local.node_device(context))
    delta = local.flat_of(model) - start
    new, change = control_step(own, server, delta, result.steps, config.lr)
    encoded, _ = local.encode(change, config, task, local.store(context, _CONTROL_MEMORY), generator, model)
    reply = upload(msg, context, config, task, delta, examples=result.examples, memory=local.store(context, _STATE),
                   generator=generator, started=started,
                   metrics={"train-loss": result.loss, "train-seconds": result.seconds, "local-steps": result.steps,
                            "control-norm": float(new.norm())}, model=model)
    reply.content.array_records[UPDATE_RECORD][CONTROL_KEY] = payload_array(encoded)
    state.put_tensor("control", new)  # kept only once the reply is built
    return reply
