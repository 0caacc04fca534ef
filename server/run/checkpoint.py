"""The coordinator's checkpoint: everything needed to continue a run after a crash.

One file, ``checkpoint/state.pt``, rewritten atomically after every step (see ``deploy.atomic``); the
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

from fedge.deploy.atomic import atomic_torch_save

__all__ = ["Checkpoint", "CheckpointError", "CheckpointStore", "IncompatibleCheckpointError"]

log = logging.getLogger(__name__)

_FORMAT = "fedge.checkpoint/2"
_KNOWN_OLD = {"fedge.checkpoint/1": "written by Fedge before the round engine (FedAvg only, no algorithm state)"}


class CheckpointError(RuntimeError):
    """No usable checkpoint could be read although one exists, or it belongs to another run."""


class IncompatibleCheckpointError(CheckpointError):
    """A readable checkpoint of an older format or of another run: refused, and left where it is."""


@dataclass
class Checkpoint:
    """Format 2: ``{format, algorithm, step, task, numel, state}``. ``state`` is the algorithm's own
    (``Algorithm.state_dict``: tensors, numbers, strings, lists and dicts of them); the algorithm
    validates it on load. ``algorithm`` is its canonical spec, ``numel`` the model size."""

    round: int  # last completed step
    algorithm: str
    task: str
    numel: int
    state: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "round": int(self.round),
            "algorithm": self.algorithm,
            "task": self.task,
            "numel": int(self.numel),
            "state": _detached(self.state),
        }

    @classmethod
    def from_dict(cls, raw: Any) -> Checkpoint:
        if not isinstance(raw, dict):
            raise CheckpointError("not a Fedge checkpoint (no format field)")
        fmt = raw.get("format")
        if fmt in _KNOWN_OLD:
            raise IncompatibleCheckpointError(f"checkpoint format {fmt!r} is {_KNOWN_OLD[fmt]}; this Fedge reads {_FORMAT!r}. "
                                  "Start a new run directory (the old run's model.pt and metrics stay usable)")
        if fmt != _FORMAT:
            raise CheckpointError(f"not a {_FORMAT} checkpoint (format {fmt!r})")
        round_ = raw.get("round")
        if not isinstance(round_, int) or isinstance(round_, bool) or round_ < 0:
            raise CheckpointError(f"checkpoint round {round_!r} is invalid")
        numel = raw.get("numel")
        if not isinstance(numel, int) or numel <= 0:
            raise CheckpointError(f"checkpoint model size {numel!r} is invalid")
        for key in ("algorithm", "task"):
            if not isinstance(raw.get(key), str) or not raw[key]:
                raise CheckpointError(f"checkpoint {key} is missing")
        state = raw.get("state")
        if not isinstance(state, dict):
            raise CheckpointError("checkpoint state is not a dict")
        _check_finite(state, "state")
        return cls(round=round_, algorithm=raw["algorithm"], task=raw["task"], numel=numel, state=state)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {str(k): _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_detached(v) for v in value]
    return value


def _check_finite(value: Any, where: str) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"checkpoint {where} contains NaN or inf")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{where}[{i}]")


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
            except IncompatibleCheckpointError as err:
                raise IncompatibleCheckpointError(f"{path}: {err}") from None
            except Exception as err:  # corrupt files surface as several unrelated exception types
                errors.append(f"{path.name}: {err}")
                # Move it aside, so the next save cannot rotate it over the good previous checkpoint.
                quarantine = path.with_name(f"{path.stem}.corrupt-{int(time.time())}.pt")
                os.replace(path, quarantine)
                log.error("checkpoint %s is unreadable (%s); kept as %s, trying an older one",
                          path, err, quarantine.name)
        raise CheckpointError("no readable checkpoint in " + str(self.directory) + ": " + "; ".join(errors))
