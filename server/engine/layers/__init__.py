"""The engine's layers: cross-cutting features held around every algorithm, one file each.

``selection`` (which devices a step asks: uniform or Oort's system-aware rule),
``update_guard`` (norm bound, weight cap), ``downlink`` (full or lattice model to devices),
``secure_aggregation`` (only the sum is revealed), ``differential_privacy`` (client-level DP:
Poisson sampling, clipping, noise, ledger) and ``model_average`` (what the run delivers). The
interface is :class:`~fedge.server.engine.layers.base.Layer`. The engine calls the run's layers in
the order :func:`order_layers` derives from what each declares it provides and needs, whatever the
order they were registered in. Adding a layer is one file here (or a class anywhere) and one
:func:`register_layer` call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedge.server.engine.layers.base import BOUNDED, MODEL, NOISE, SAMPLE, SUM, Exchange, Failure, Layer
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

__all__ = ["BOUNDED", "LAYERS", "MODEL", "NOISE", "SAMPLE", "SUM", "Exchange", "Failure", "Layer", "build_layers",
           "order_layers", "register_layer"]

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


def order_layers(layers: list[Layer]) -> list[Layer]:
    """The run's layers in the order their declarations imply: every provider of a facet a layer
    needs runs before it; among layers that do not depend on each other, by key (so the order
    never depends on registration). Two layers that provide one facet (two rules choosing the
    step's devices) or a cycle of needs raise ``SettingsError`` with the reason: the one place where
    a combination of layers that cannot work is refused, before any process starts."""
    providers: dict[str, Layer] = {}
    for layer in sorted(layers, key=lambda layer: layer.key):
        for facet in sorted(layer.provides):
            if facet in providers:
                raise SettingsError(f"{providers[facet].key} and {layer.key} both provide the step's {facet!r}: "
                                    "a run can have one of them; turn the other off")
            providers[facet] = layer
    before = {layer.key: {providers[f].key for f in layer.needs if f in providers} - {layer.key} for layer in layers}
    ordered: list[Layer] = []
    waiting = sorted(layers, key=lambda layer: layer.key)
    while waiting:
        done = {layer.key for layer in ordered}
        ready = next((layer for layer in waiting if before[layer.key] <= done), None)
        if ready is None:
            cycle = ", ".join(f"{layer.key} needs {sorted(before[layer.key] - done)}" for layer in waiting)
            raise SettingsError(f"the layers' needs form a cycle: {cycle}")
        ordered.append(ready)
        waiting.remove(ready)
    return ordered


def build_layers(algorithm: Algorithm, run_dir: RunDirectory | None = None) -> list[Layer]:
    """The run's layers, ordered (:func:`order_layers`): those whose settings are on. A setting a
    layer cannot honour with this algorithm, or a combination of layers that cannot work, raises
    ``SettingsError`` with the reason (the CLI's preflight calls this before any process starts)."""
    built = (cls.build(algorithm, run_dir) for cls in LAYERS)
    return order_layers([layer for layer in built if layer is not None])
