"""The refusal shared by the layers that need each device's update on its own (FedNova's
normalisation, SCAFFOLD's control variates): secure aggregation and DP hand the coordinator only a
sum, or a noised one."""

from __future__ import annotations

from fedge.server.settings import RunSettings, SettingsError

__all__ = ["refuse_private_aggregation"]


def refuse_private_aggregation(settings: RunSettings, why: str) -> None:
    """Raise :class:`SettingsError` (``why``, then the settings) when the run sets either."""
    refused = [f"{key}={value!r}" for key, value, default in (
        ("secure-aggregation", settings.secure_aggregation, "none"),
        ("differential-privacy", settings.differential_privacy, "none")) if value != default]
    if refused:
        raise SettingsError(f"{why}: {', '.join(refused)} is not possible with it")
