"""The engine's layers: cross-cutting features held around every algorithm, one file each.

``selection`` (which devices a step asks: uniform or Oort's system-aware rule),
``update_guard`` (norm bound, weight cap), ``downlink`` (full or lattice model to devices),
``secure_aggregation`` (only the sum is revealed), ``differential_privacy`` (client-level DP:
Poisson sampling, clipping, noise, ledger) and ``model_average`` (what the run delivers); an
algorithm adds its own (``Algorithm.layers``: FedNova's, SCAFFOLD's, EASGD's). The
interface is :class:`~fedge.coordinator.layer.Layer` (shared with ``fedge.flower.layered``). The engine calls the run's layers in
the order :func:`order_layers` derives from what each declares it provides and needs, whatever the
order they were registered in. Adding a layer is one file here (or a class anywhere) and one
:func:`register_layer` call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedge.coordinator.layer import BOUNDED, MODEL, NOISE, SAMPLE, SUM, Exchange, Failure, Layer, LayerOrderError, order_layers
from fedge.server.engine.layers.differential_privacy import DifferentialPrivacyLayer
from fedge.server.engine.layers.downlink import DownlinkLayer
from fedge.server.engine.layers.model_average import ModelAverageLayer
from fedge.server.engine.layers.secure_aggregation import SecureAggregationLayer
from fedge.server.engine.layers.selection import SelectionLayer
from fedge.server.engine.layers.update_guard import UpdateGuardLayer
from fedge.server.settings import SettingsError

if TYPE_CHECKING:
    from fedge.server.engine.algorithm import Algorithm
    from fedge.server.run.run_directory import RunDirectory

__all__ = ["BOUNDED", "LAYERS", "MODEL", "NOISE", "SAMPLE", "SUM", "Exchange", "Failure", "Layer", "LayerOrderError",
           "build_layers", "order_layers", "register_layer"]

#: every layer class; their order here means nothing (``order_layers`` decides)
LAYERS: list[type[Layer]] = [SelectionLayer, UpdateGuardLayer, DownlinkLayer, SecureAggregationLayer,
                             DifferentialPrivacyLayer, ModelAverageLayer]


def register_layer(cls: type[Layer]) -> type[Layer]:
    """Add a layer class; its ``key`` must be new. Where it runs follows from its ``provides`` and
    ``needs``."""
    if not isinstance(getattr(cls, "key", None), str) or any(c.key == cls.key for c in LAYERS if c is not cls):
        raise ValueError(f"{cls!r} needs a class attribute key (a string) no other layer uses")
    if cls not in LAYERS:
        LAYERS.append(cls)
    return cls


def build_layers(algorithm: Algorithm, run_dir: RunDirectory | None = None) -> list[Layer]:
    """The run's layers, ordered (:func:`order_layers`): those whose settings are on. A setting a
    layer cannot honour with this algorithm, or a combination of layers that cannot work, raises
    ``SettingsError`` with the reason (the CLI's preflight calls this before any process starts)."""
    built = [*(cls.build(algorithm, run_dir) for cls in LAYERS), *algorithm.layers()]
    try:
        return order_layers([layer for layer in built if layer is not None])
    except LayerOrderError as err:
        raise SettingsError(str(err)) from None
