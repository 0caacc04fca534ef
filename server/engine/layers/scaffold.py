"""SCAFFOLD in Fedge's engine: ``algorithm = "scaffold"`` is FedAvg with the control-variate layer
both coordinators run (``fedge.protocol.scaffold_layer``), and what it refuses."""

from __future__ import annotations

from fedge.protocol.scaffold_layer import ControlVariates
from fedge.server.engine.algorithm import Algorithm
from fedge.server.settings import SettingsError

__all__ = ["ScaffoldLayer"]


class ScaffoldLayer(ControlVariates):
    @classmethod
    def build(cls, algorithm: Algorithm, run_dir: object = None) -> ScaffoldLayer | None:
        if algorithm.name != "scaffold":
            return None
        s = algorithm.ctx.settings
        refused = [f"{key}={value!r}" for key, value, default in (
            ("secure-aggregation", s.secure_aggregation, "none"),
            ("differential-privacy", s.differential_privacy, "none")) if value != default]
        if refused:
            raise SettingsError(f"scaffold needs each device's update and control change on their own: "
                                f"{', '.join(refused)} is not possible with it")
        return cls(bits=0 if s.codec == "none" else int(getattr(algorithm, "control_bits", 8)), lr=s.lr)
