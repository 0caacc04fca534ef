"""A round algorithm from outside Fedge: FedAvg whose clients' learning rate decays by ``decay``
every round (lr × decay^(round-1)), registered with its server class and its device handler in one
call. Use it as ``algorithm = "fedavg_decay:decay=0.9"``; every process of the run loads this
module (``plugins = "decaying_fedavg"``)."""

from __future__ import annotations

import dataclasses
import time

from flwr.app import Context, Message

from fedge.edge_client import local
from fedge.protocol import CONFIG_RECORD, MODEL_RECORD, read_state_dict
from fedge.server.algorithms.fedavg import FedAvg
from fedge.server.algorithms.registry import register_algorithm
from fedge.server.engine.algorithm import Outgoing, RunContext, Step


class DecayingFedAvg(FedAvg):
    name = "fedavg_decay"
    settings_used = frozenset({"server-opt", "aggregator"})

    def __init__(self, ctx: RunContext, decay: float = 0.9) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        super().__init__(ctx)
        self.decay = decay

    @property
    def spec(self) -> str:
        return f"fedavg_decay:decay={self.decay}"

    def configure(self, step: Step, nodes: list[int]) -> list[Outgoing]:
        outgoing = super().configure(step, nodes)
        for o in outgoing:
            o.content.config_records[CONFIG_RECORD]["lr-scale"] = self.decay ** (step.number - 1)
        return outgoing


def train(msg: Message, context: Context) -> Message:
    """The device side: FedAvg's local training at the decayed rate, the update encoded with the
    run's codec through the node's error-feedback memory."""
    started = time.perf_counter()
    config = local.round_config(msg)
    task = local.task_of(config)
    model = task.build_model()
    model.load_state_dict(read_state_dict(msg.content, MODEL_RECORD, model.state_dict()), strict=True)
    start = local.flat_of(model)
    generator = local.node_generator(config, context, "train")
    scaled = dataclasses.replace(config, lr=config.lr * config.number("lr-scale", low=0.0, high=1.0))
    result = local.train(model, local.local_data(context, config), scaled, generator)
    delta = local.flat_of(model) - start
    payload, residual = local.encode(delta, config, task, local.store(context, "fedavg_decay"), generator)
    return local.train_reply(msg, payload, {"num-examples": result.examples, "train-loss": result.loss,
                                            "train-seconds": result.seconds, "residual-norm": residual}, started)


register_algorithm(DecayingFedAvg, train)
