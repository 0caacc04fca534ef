"""Secure aggregation in Fedge's engine (``secure-aggregation = "secagg:..."``): the layer both
coordinators run (``fedge.coordinator.secure_layer``), built from the run's settings, and what those
settings refuse. The algorithm declares only that its step works from a mean or a sum
(``Algorithm.aggregate``).
"""

from __future__ import annotations

from typing import Any

from fedge.privacy.credentials import CredentialError
from fedge.privacy.dp_spec import parse_differential_privacy
from fedge.privacy.spec import parse_secure_aggregation
from fedge.coordinator.secure_layer import SecureAggregation
from fedge.coordinator.secure_session import SecureSession
from fedge.server.engine.algorithm import Algorithm
from fedge.server.settings import SettingsError

__all__ = ["SecureAggregationLayer", "refuse_reason"]


def refuse_reason(algorithm: Algorithm) -> str | None:
    """Why an algorithm cannot run under secure aggregation (None: it can)."""
    name, settings = algorithm.name, algorithm.ctx.settings
    if algorithm.asynchronous:
        return (f"{name} aggregates each update as it lands (asynchronously); secure aggregation only "
                "reveals the sum of a whole round")
    if algorithm.aggregate not in ("mean", "sum"):
        return (f"{name} needs each device's update (gossip relays them, robust rules rank them); secure "
                "aggregation only reveals their sum")
    if not algorithm.device_layers:
        return (f"the devices of {name} run the plugin's own handler, which does not send its update through "
                "Fedge's upload layers, so it would never be masked; register it with a handler built by "
                "fedge.edge_client.layers (see docs/extending.md)")
    if settings.aggregator != "mean":
        return (f"aggregator {settings.aggregator!r} works on individual updates; secure aggregation only "
                "reveals their sum")
    if settings.update_norm != "none":
        return ("update-norm bounds each decoded update, which the coordinator never sees under secure "
                "aggregation; the shared grid's clip bounds every coordinate instead")
    return None


class SecureAggregationLayer(SecureAggregation):
    """The engine's secure aggregation: the shared layer, built from the run's settings."""

    @classmethod
    def build(cls, algorithm: Algorithm, run_dir: Any = None) -> SecureAggregationLayer | None:
        """The run's secure aggregation, or None; a combination that cannot work is refused here
        (the CLI's preflight builds every layer before any process starts)."""
        try:
            spec = parse_secure_aggregation(algorithm.ctx.settings.secure_aggregation)
        except ValueError as err:
            raise SettingsError(f"secure-aggregation: {err}") from None
        if spec is None:
            return None
        reason = refuse_reason(algorithm)
        if reason is not None:
            raise SettingsError(f"secure-aggregation cannot run with algorithm {algorithm.spec!r}: {reason}")
        if algorithm.ctx.settings.clients_per_round < 2:
            raise SettingsError("secure-aggregation needs clients-per-round >= 2: one device's sum is its update")
        dp = parse_differential_privacy(algorithm.ctx.settings.differential_privacy)
        try:
            return cls(SecureSession(spec, algorithm.ctx.settings.seed), algorithm.ctx.numel,
                       weighted=algorithm.weighted, dp_spec=dp)
        except (CredentialError, ValueError) as err:  # the layer refuses what it cannot carry
            raise SettingsError(f"secure-aggregation: {err}") from None
