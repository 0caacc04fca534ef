"""Test-wide setup: offline, telemetry off, deterministic hypothesis profile."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

for key, value in {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}.items():
    os.environ.setdefault(key, value)

settings.register_profile(
    "fedge", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("fedge")
