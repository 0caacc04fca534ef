"""The coordinator's checkpoint: everything needed to continue a run after a crash.

One file, ``checkpoint/state.pt``, rewritten atomically after every round (see ``deploy.atomic``); the
previous one is kept as ``state.prev.pt`` so that even a checkpoint damaged after it was written
(disk fault) leaves a round to resume from. Loading never executes code (``weights_only=True``).
The client-sampling RNG needs no saving: each round's sample is derived from ``(seed, round)``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deploy.atomic import atomic_torch_save

__all__ = ["Checkpoint", "CheckpointError", "CheckpointStore"]

log = logging.getLogger(__name__)

_FORMAT = "fedge.checkpoint/1"


class CheckpointError(RuntimeError):
    """No usable checkpoint could be read although one exists."""


@dataclass
class Checkpoint:
    round: int  # last completed round
    params: torch.Tensor  # flat float32 global model
    optimizer_state: dict[str, torch.Tensor] = field(default_factory=dict)
    task: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "round": int(self.round),
            "params": self.params.detach().cpu().to(torch.float32).clone(),
            "optimizer_state": {k: v.detach().cpu().clone() for k, v in self.optimizer_state.items()},
            "task": self.task,
        }

    @classmethod
    def from_dict(cls, raw: Any) -> Checkpoint:
        if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
            raise CheckpointError(f"not a {_FORMAT} checkpoint")
        params = raw.get("params")
        if not isinstance(params, torch.Tensor) or params.dim() != 1:
            raise CheckpointError("checkpoint params are missing or not a flat tensor")
        if not bool(torch.isfinite(params).all()):
            raise CheckpointError("checkpoint params contain NaN or inf")
        round_ = raw.get("round")
        if not isinstance(round_, int) or round_ < 0:
            raise CheckpointError(f"checkpoint round {round_!r} is invalid")
        state = raw.get("optimizer_state") or {}
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) and v.shape == params.shape
            and bool(torch.isfinite(v).all())
            for k, v in state.items()
        ):
            raise CheckpointError("checkpoint optimizer state is not a set of finite model-sized tensors")
        return cls(round=round_, params=params, optimizer_state=dict(state), task=str(raw.get("task", "")))


class CheckpointStore:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.current = self.directory / "state.pt"
        self.previous = self.directory / "state.prev.pt"

    def save(self, checkpoint: Checkpoint) -> None:
        """Keep the current checkpoint as the previous one, then write the new one atomically."""
        if self.current.exists():
            os.replace(self.current, self.previous)
        atomic_torch_save(self.current, checkpoint.to_dict())

    def load(self) -> Checkpoint | None:
        """The newest readable checkpoint, or None when the run has none yet."""
        candidates = [p for p in (self.current, self.previous) if p.exists()]
        if not candidates:
            return None
        errors = []
        for path in candidates:
            try:
                raw = torch.load(path, map_location="cpu", weights_only=True)
                return Checkpoint.from_dict(raw)
            except Exception as err:  # corrupt files surface as several unrelated exception types
                errors.append(f"{path.name}: {err}")
                # Move it aside, so the next save cannot rotate it over the good previous checkpoint.
                quarantine = path.with_name(f"{path.stem}.corrupt-{int(time.time())}.pt")
                os.replace(path, quarantine)
                log.error("checkpoint %s is unreadable (%s); kept as %s, trying an older one",
                          path, err, quarantine.name)
        raise CheckpointError("no readable checkpoint in " + str(self.directory) + ": " + "; ".join(errors))
