"""FedNova in Fedge's engine: ``algorithm = "fednova"`` is FedAvg with the normalising layer both
coordinators run (``fedge.protocol.fednova_layer``), at the run's ``momentum``, and what it refuses."""

from __future__ import annotations

from fedge.protocol.fednova_layer import NormalizedAveraging
from fedge.server.engine.algorithm import Algorithm
from fedge.server.settings import SettingsError

__all__ = ["FedNovaLayer"]


class FedNovaLayer(NormalizedAveraging):
    @classmethod
    def build(cls, algorithm: Algorithm, run_dir: object = None) -> FedNovaLayer | None:
        if algorithm.name != "fednova":
            return None
        s = algorithm.ctx.settings
        # (a robust aggregator and prox-mu are refused for fednova with every algorithm-specific setting)
        refused = [f"{key}={value!r}" for key, value, default in (
            ("secure-aggregation", s.secure_aggregation, "none"),
            ("differential-privacy", s.differential_privacy, "none")) if value != default]
        if refused:
            raise SettingsError(f"fednova normalises each update by its own local steps, so it needs every update "
                                f"on its own and their weighted mean: {', '.join(refused)} is not possible with it")
        return cls(momentum=s.momentum)
