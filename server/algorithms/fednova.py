"""Normalized averaging: ``algorithm = "fednova"``.

FedAvg whose devices may take different numbers of local steps (more data, more epochs, a faster
device) without pulling the model toward their own objective (Wang et al., NeurIPS 2020). The
algorithm is FedAvg's; the normalisation is the layer both coordinators run
(``fedge.protocol.fednova_layer``, added by ``fedge.server.engine.layers.fednova`` for this
algorithm): each update divided by its local step norm, the mean scaled back by the effective
number of steps. Devices run FedAvg's handler, which reports ``local-steps``.
"""

from __future__ import annotations

from fedge.server.algorithms.fedavg import FedAvg

__all__ = ["FedNova"]


class FedNova(FedAvg):
    name = "fednova"
    device_handler = "fedavg"  # the devices do FedAvg's work and report their steps
    # not prox-mu: FedProx's proximal term changes the step weights (a_i) this normalises by; not
    # aggregator: the normalisation rescales the weighted mean, which a robust rule does not take
    settings_used = frozenset({"server-opt", "downlink-codec", "model-average"})

    @property
    def spec(self) -> str:
        return "fednova"
