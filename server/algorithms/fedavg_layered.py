"""FedAvg with one layer both coordinators run: ``fednova``, ``scaffold`` and ``easgd``.

Each is FedAvg's algorithm and device handler with the layer a Flower app wraps its strategy in
(``layered(FedAvg(), <layer>)``), so the two coordinators run the same rule:

* ``fednova`` (Wang et al., NeurIPS 2020): devices may take different numbers of local steps without
  pulling the model toward their own objective; ``fedge.coordinator.fednova_layer`` divides each update
  by its local step norm at the run's momentum and scales the mean back. Devices report
  ``local-steps``.
* ``scaffold[:control-bits=8]`` (Karimireddy et al., ICML 2020; the rules in
  ``fedge.aggregation.scaffold``): each local step corrected by ``c - c_i``;
  ``fedge.coordinator.scaffold_layer`` sends the server's ``c`` down with every train message and sums
  each reply's ``dc_i`` beside its update, both at ``control-bits`` (QSGD; fp32 when the run's codec
  is ``none``) with error feedback. Devices run the SCAFFOLD handler, which keeps ``c_i``.
* ``easgd[:alpha=0.3,beta=0.9]`` (Zhang, Choromanska, LeCun, NeurIPS 2015): each device keeps its own
  model x_i between rounds, trains it, sends the elastic difference δ_i = α(x_i − x̃) against the
  center x̃ (the global model) and keeps x_i − δ_i (FedAvg's handler, when the message names α);
  ``fedge.coordinator.elastic_layer`` counts every difference once and moves the center by
  (β / (α m)) Σ δ_i over the m replies used: with the paper's coupling β = nα and all n answering,
  its x̃ + Σ δ_i. ``alpha=0`` gives that coupling, α = β / clients-per-round. Defaults β = 0.9 (the
  paper's), α = 0.3 (measured: on digits with 16 Dirichlet(0.5) clients and 5-epoch periods the
  paper's α = 0.056 reached 87.5%, α = 0.2 / 0.3 / 0.6 / 1.0 reached 93.6 / 94.4 / 93.1 / 89.4%).
  Rows report ``center_distance`` (mean ‖x_i − x̃‖) and the devices' own models' primary metric on
  their held-out part (``client_model_accuracy``).

What each cannot meet is refused with the run's other layers (``fedge.server.engine.layers.COMBINATIONS``).
"""

from __future__ import annotations

from typing import Any

from fedge.coordinator.elastic_layer import ElasticAveraging
from fedge.coordinator.fednova_layer import NormalizedAveraging
from fedge.coordinator.layer import Layer
from fedge.coordinator.scaffold_layer import ControlVariates
from fedge.server.algorithms.fedavg import FedAvg
from fedge.server.engine.algorithm import RunContext
from fedge.server.settings import SettingsError

__all__ = ["EASGD", "FedNova", "Scaffold"]


class FedNova(FedAvg):
    name = "fednova"
    device_handler = "fedavg"  # the devices do FedAvg's work and report their steps
    # not prox-mu: FedProx's proximal term changes the step weights (a_i) this normalises by; not
    # aggregator: the normalisation rescales the weighted mean, which a robust rule does not take
    settings_used = frozenset({"server-opt", "downlink-codec", "model-average"})

    @property
    def spec(self) -> str:
        return "fednova"

    def layers(self) -> list[Layer]:
        return [NormalizedAveraging(momentum=self.ctx.settings.momentum)]


class Scaffold(FedAvg):
    name = "scaffold"
    device_handler = "scaffold"
    # not prox-mu (the correction replaces the proximal pull); not aggregator (a robust rule would
    # choose among updates whose control changes are summed beside them all)
    settings_used = frozenset({"server-opt", "downlink-codec", "model-average"})

    def __init__(self, ctx: RunContext, control_bits: int = 8) -> None:
        super().__init__(ctx)
        if isinstance(control_bits, bool) or not 1 <= int(control_bits) <= 16:
            raise SettingsError(f"scaffold control-bits must be in 1..16, got {control_bits!r}")
        self.control_bits = int(control_bits)

    @property
    def spec(self) -> str:
        return f"scaffold:control-bits={self.control_bits}"

    def layers(self) -> list[Layer]:
        s = self.ctx.settings
        return [ControlVariates(bits=0 if s.codec == "none" else self.control_bits, lr=s.lr)]


class EASGD(FedAvg):
    name = "easgd"
    device_handler = "fedavg"  # FedAvg's handler takes the elastic step when the message names alpha
    weighted = False  # every elastic difference counts once: the center moves by their sum
    aggregate = "sum"
    settings_used = frozenset({"downlink-codec", "model-average"})

    def __init__(self, ctx: RunContext, beta: float = 0.9, alpha: float = 0.3) -> None:
        super().__init__(ctx)
        if not 0 < beta <= 1:
            raise ValueError(f"easgd beta must be in (0, 1], got {beta}")
        if alpha == 0.0:
            alpha = beta / ctx.settings.clients_per_round  # the paper's coupling beta = n * alpha
        if not 0 < alpha <= 1:
            raise ValueError(f"easgd alpha must be in (0, 1], got {alpha}")
        self.alpha, self.beta = float(alpha), float(beta)

    @property
    def spec(self) -> str:
        return f"easgd:alpha={self.alpha:g},beta={self.beta:g}"

    def layers(self) -> list[Layer]:
        return [ElasticAveraging(self.alpha, self.beta, score=f"client_model_{self.ctx.task.primary_metric}")]

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.spec, "alpha": self.alpha, "beta": self.beta,
                "clients_per_round": self.ctx.settings.clients_per_round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "center" in state and "params" not in state:  # a checkpoint of the EASGD algorithm before it was FedAvg's
            state = {"params": state["center"]}
        super().load_state_dict(state)
