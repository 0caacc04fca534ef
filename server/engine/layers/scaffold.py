"""SCAFFOLD in Fedge's engine: ``algorithm = "scaffold"`` is FedAvg with the control-variate layer
both coordinators run (``fedge.protocol.scaffold_layer``), and what it refuses."""

from __future__ import annotations

from fedge.protocol.scaffold_layer import ControlVariates
from fedge.server.engine.algorithm import Algorithm
from fedge.server.engine.layers.per_device import refuse_private_aggregation

__all__ = ["ScaffoldLayer"]


class ScaffoldLayer(ControlVariates):
    @classmethod
    def build(cls, algorithm: Algorithm, run_dir: object = None) -> ScaffoldLayer | None:
        if algorithm.name != "scaffold":
            return None
        s = algorithm.ctx.settings
        refuse_private_aggregation(s, "scaffold needs each device's update and control change on their own")
        return cls(bits=0 if s.codec == "none" else int(getattr(algorithm, "control_bits", 8)), lr=s.lr)
