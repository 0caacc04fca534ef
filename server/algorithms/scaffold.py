"""Stochastic controlled averaging: ``algorithm = "scaffold[:control-bits=8]"``.

SCAFFOLD (Karimireddy et al., ICML 2020; the rules in ``fedge.aggregation.scaffold``) corrects each
device's local steps by ``c - c_i`` so that devices with skewed data stop drifting toward their own
optimum. The algorithm is FedAvg's; the control variates are the layer both coordinators run
(``fedge.protocol.scaffold_layer``, added by ``fedge.server.engine.layers.scaffold``): the server's
``c`` goes down with every train message and each reply's ``dc_i`` is summed beside its update,
both encoded at ``control-bits`` (QSGD; fp32 when the run's codec is ``none``) with error feedback.
Devices run the SCAFFOLD handler (``fedge.edge_client.algorithms.scaffold``), which keeps ``c_i``
in their node state across rounds.
"""

from __future__ import annotations

from fedge.server.algorithms.fedavg import FedAvg
from fedge.server.engine.algorithm import RunContext
from fedge.server.settings import SettingsError

__all__ = ["Scaffold"]


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
