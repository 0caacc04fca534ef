"""FedNova in Fedge's engine: ``algorithm = "fednova"`` is FedAvg with the normalising layer both
coordinators run (``fedge.protocol.fednova_layer``), at the run's ``momentum``, and what it refuses."""

from __future__ import annotations

from fedge.protocol.fednova_layer import NormalizedAveraging
from fedge.server.engine.algorithm import Algorithm
from fedge.server.engine.layers.per_device import refuse_private_aggregation

__all__ = ["FedNovaLayer"]


class FedNovaLayer(NormalizedAveraging):
    @classmethod
    def build(cls, algorithm: Algorithm, run_dir: object = None) -> FedNovaLayer | None:
        if algorithm.name != "fednova":
            return None
        s = algorithm.ctx.settings
        # (a robust aggregator and prox-mu are refused for fednova with every algorithm-specific setting)
        refuse_private_aggregation(s, "fednova normalises each update by its own local steps, so it needs every "
                                      "update on its own and their weighted mean")
        return cls(momentum=s.momentum)
