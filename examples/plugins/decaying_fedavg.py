"""A round algorithm from outside Fedge: FedAvg whose clients' learning rate decays by ``decay``
every round (lr × decay^(round-1)), registered with its server class and its device handler in one
call. Use it as ``algorithm = "fedavg_decay:decay=0.9"``; every process of the run loads this
module (``plugins = "decaying_fedavg"``).

The device handler is FedAvg's, built around one change of the round's config
(``make_train``): it inherits the device's layers (the downlink, clipping under differential
privacy, masking under secure aggregation), so the algorithm runs with all of them."""

from __future__ import annotations

import dataclasses

from fedge.edge_client.algorithms.fedavg import make_train
from fedge.protocol import CONFIG_RECORD
from fedge.protocol.round_config import RoundConfig
from fedge.server.algorithms.fedavg import FedAvg
from fedge.server.algorithms.registry import register_algorithm
from fedge.server.engine.algorithm import Outgoing, RunContext, Step

#: the config key this plugin adds to FedAvg's messages
LR_SCALE = "lr-scale"


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
            o.content.config_records[CONFIG_RECORD][LR_SCALE] = self.decay ** (step.number - 1)
        return outgoing


def decayed(config: RoundConfig) -> RoundConfig:
    """The round's config with the learning rate the coordinator scaled for this round."""
    return dataclasses.replace(config, lr=config.lr * config.number(LR_SCALE, low=0.0, high=1.0))


register_algorithm(DecayingFedAvg, make_train(decayed, namespace="fedavg_decay"))
