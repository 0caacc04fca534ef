"""The engine's layers: cross-cutting features held around every algorithm, one file each.

``selection`` (which devices a step asks: uniform or Oort's system-aware rule),
``update_guard`` (norm bound, weight cap), ``downlink`` (full or lattice model to devices),
``secure_aggregation`` (only the sum is revealed), ``differential_privacy`` (client-level DP:
Poisson sampling, clipping, noise, ledger) and ``model_average`` (what the run delivers). The
interface is :class:`~fedge.server.engine.layers.base.Layer`; the engine calls the layers in the
order of :data:`LAYERS`. Adding a layer is one file here and one :func:`register_layer` call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedge.server.engine.layers.base import Exchange, Failure, Layer
from fedge.server.engine.layers.differential_privacy import DifferentialPrivacyLayer
from fedge.server.engine.layers.downlink import DownlinkLayer
from fedge.server.engine.layers.model_average import ModelAverageLayer
from fedge.server.engine.layers.secure_aggregation import SecureAggregationLayer
from fedge.server.engine.layers.selection import SelectionLayer
from fedge.server.engine.layers.update_guard import UpdateGuardLayer

if TYPE_CHECKING:
    from fedge.server.engine.algorithm import Algorithm
    from fedge.server.run.run_directory import RunDirectory

__all__ = ["LAYERS", "Exchange", "Failure", "Layer", "build_layers", "register_layer"]

#: every layer class, in the order the engine calls them at each hook: the guard bounds an update
#: before differential privacy clips it; the downlink ships a model before secure aggregation
#: staples its record; the model average sees the model every other layer agreed on
LAYERS: list[type[Layer]] = [SelectionLayer, UpdateGuardLayer, DownlinkLayer, SecureAggregationLayer,
                             DifferentialPrivacyLayer, ModelAverageLayer]


def register_layer(cls: type[Layer], *, before: type[Layer] | None = None) -> type[Layer]:
    """Add a layer class (last, or just before ``before``); its ``key`` must be new."""
    if not isinstance(getattr(cls, "key", None), str) or any(c.key == cls.key for c in LAYERS if c is not cls):
        raise ValueError(f"{cls!r} needs a class attribute key (a string) no other layer uses")
    if cls not in LAYERS:
        LAYERS.insert(LAYERS.index(before) if before is not None else len(LAYERS), cls)
    return cls


def build_layers(algorithm: Algorithm, run_dir: RunDirectory | None = None) -> list[Layer]:
    """The run's layers, in order: those whose settings are on. A setting a layer cannot honour
    with this algorithm raises ``SettingsError`` with the reason (the CLI's preflight calls this
    before any process starts)."""
    built = (cls.build(algorithm, run_dir) for cls in LAYERS)
    return [layer for layer in built if layer is not None]
