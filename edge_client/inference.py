"""On-device inference from a signed bundle: verify, then run with onnxruntime. Imports no torch.

    from fedge.edge_client.inference import EdgeModel
    model = EdgeModel.load("bundle/", trusted_keys=["signing-key.pub.pem"])
    logits = model.predict(x)           # x: float32 numpy array, shape as the manifest says

Loading runs every check of :func:`deploy.bundle.verify_bundle` (signature, hash and size over the
bytes actually loaded, expiry, anti-rollback, runtime, signature of the graph, golden self-test)
and records the accepted round in the device's anti-rollback store, so an older bundle is refused
from then on, across restarts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedge.deploy.bundle import (
    AcceptedRounds,
    LatencyReport,
    VerifiedBundle,
    install,
    measure_latency,
    verify_bundle,
)
from fedge.deploy.keys import load_public_key

__all__ = ["EdgeModel", "default_state_path"]


def default_state_path() -> Path:
    """Where a device keeps the last accepted round per model (``$FEDGE_EDGE_HOME`` overrides)."""
    home = os.environ.get("FEDGE_EDGE_HOME")
    if home:
        return Path(home).absolute() / "accepted-rounds.json"
    state = os.environ.get("XDG_STATE_HOME")  # empty or relative means unset (XDG spec)
    base = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    return base / "fedge-edge" / "accepted-rounds.json"


@dataclass
class EdgeModel:
    bundle: VerifiedBundle

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        trusted_keys: Sequence[str | os.PathLike[str]],
        *,
        state: str | os.PathLike[str] | None = None,
        threads: int = 1,
        now: float | None = None,
    ) -> EdgeModel:
        keys = [load_public_key(path) for path in trusted_keys]
        store = AcceptedRounds(Path(state) if state is not None else default_state_path())
        return cls(verify_bundle(directory, keys, accepted=store, threads=threads, now=now))

    @property
    def metadata(self) -> dict[str, Any]:
        return self.bundle.predicate

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Model outputs for ``x`` (checked against the signed input signature first)."""
        return self.bundle.run(x)

    def latency(self, x: np.ndarray, runs: int = 50) -> LatencyReport:
        return measure_latency(self.bundle, x, runs=runs)

    def install(self, root: str | os.PathLike[str]) -> Path:
        """Atomically make this (verified) model the active one under ``root/<name>``."""
        return install(self.bundle, root)
