"""The run directory: everything a run produced and everything it needs to resume.

::

    config.json      resolved settings, versions, seed (written when the run starts)
    algorithm.json   the algorithm and its layers as built (spec, topology, codecs, bounds)
    metrics.jsonl    one JSON object per round
    checkpoint/      latest atomic coordinator state (state.pt, state.prev.pt)
    model.pt         final fp32 global model (deploy.model_file format)
    plot.png         accuracy and cumulative uplink MB per round
    summary.json     final figures of the run
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.deploy.atomic import atomic_write_text
from fedge.server.run.metrics_log import MetricsLog
from fedge.server.settings import RunSettings, SettingsError

if TYPE_CHECKING:
    from fedge.server.run.checkpoint import CheckpointStore

__all__ = ["RunDirectory"]

log = logging.getLogger(__name__)

# Settings that may change between a run and its resumption (they do not change what the saved
# state means); any other difference is refused because the checkpoint would be misread.
_RESUMABLE_CHANGES = {"rounds", "round-timeout", "wait-for-nodes", "min-replies", "run-dir"}


class RunDirectory:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).resolve()
        self.config_path = self.path / "config.json"
        self.metrics = MetricsLog(self.path / "metrics.jsonl")
        self.model_path = self.path / "model.pt"
        self.plot_path = self.path / "plot.png"
        self.summary_path = self.path / "summary.json"
        #: present while the operator wants the run to stop at the next step boundary
        self.stop_path = self.path / "stop-requested"

    @cached_property
    def checkpoints(self) -> CheckpointStore:
        """The run's checkpoints (``checkpoint/``), loaded with torch: imported here, so a launcher
        that prepares a fresh directory before any process starts imports no torch."""
        from fedge.server.run.checkpoint import CheckpointStore

        return CheckpointStore(self.path / "checkpoint")

    def _checked(self, settings: RunSettings) -> tuple[dict[str, Any], list[str]]:
        """``settings``'s run config and the keys it changes from the run recorded here (none without
        one); raises ``SettingsError`` when a changed key is one a resumed run cannot take."""
        new = settings.to_run_config()
        if not self.config_path.exists():
            return new, []
        old = json.loads(self.config_path.read_text(encoding="utf-8")).get("settings", {})
        # a setting added since the run started: the run ran with what its default does
        old = {**{k: v for k, v in RunSettings().to_run_config().items() if k not in old}, **old}
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        blocking = [k for k in changed if k not in _RESUMABLE_CHANGES]
        if blocking:
            details = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in blocking)
            raise SettingsError(f"{self.path} holds a run with different settings ({details}); "
                                "use a new run directory or the original settings")
        return new, changed

    def start(self, settings: RunSettings, extra: dict[str, Any] | None = None) -> None:
        """Create the directory and record the settings; refuse to resume under incompatible ones."""
        self.path.mkdir(parents=True, exist_ok=True)
        new, changed = self._checked(settings)
        if changed:
            log.info("resuming with changed settings: %s", ", ".join(changed))
        record = {
            "settings": new,
            "versions": _versions(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            **(extra or {}),
        }
        atomic_write_text(self.config_path, json.dumps(record, indent=2) + "\n")

    def stop_requested(self) -> bool:
        return self.stop_path.exists()

    def request_stop(self) -> None:
        atomic_write_text(self.stop_path, f"{time.time()}\n")

    def clear_stop(self) -> None:
        self.stop_path.unlink(missing_ok=True)

    def prepare_launch(self, settings: RunSettings | None = None) -> None:
        """Before a (re)start of the processes: create the directory, drop the summary of an earlier
        launch (a summary marks a finished run: only this launch may write it), clear an earlier stop
        request, and drop metrics rows past the last checkpoint (they belong to steps that run again;
        the ServerApp does the same when it resumes) so progress does not report them twice.

        With the ``settings`` the ServerApp will record, a run this directory's run cannot become is
        refused here (``SettingsError``), before anything in it is touched: the ServerApp refuses it
        too, but only after this had dropped the earlier run's summary."""
        if settings is not None:
            self._checked(settings)
        self.path.mkdir(parents=True, exist_ok=True)
        self.summary_path.unlink(missing_ok=True)
        self.clear_stop()
        checkpoint = self.checkpoints.load() if (self.path / "checkpoint").exists() else None
        self.metrics.truncate_after(checkpoint.round if checkpoint else 0)

    def write_description(self, described: dict[str, Any]) -> None:
        """``algorithm.json``: what the engine built for this run, written atomically."""
        atomic_write_text(self.path / "algorithm.json", json.dumps(described, indent=2) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.summary_path, json.dumps(summary, indent=2) + "\n")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("fedge", "flwr", "torch", "numpy", "flwr-datasets"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out
