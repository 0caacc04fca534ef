"""Experiment tracking: a run's settings, per-round figures and final files, sent where researchers
already keep their experiments (TensorBoard event files, an MLflow tracking store).

The coordinator logs, never the devices: every figure is already in the coordinator's
``metrics.jsonl`` row (NVFlare's "centralized tracking"), so a device's memory and uploads do not
change. ``metrics.jsonl`` stays the record; a sink is a copy of it in another reader's format, and a
sink that fails (a tracking server down) is logged and dropped, never the run.

    tracking = "tensorboard"                    # <run dir>/tensorboard
    tracking = "tensorboard:DIR;mlflow:URI"     # several at once, ';' between them

Pure: imports neither Flower nor torch; each writer library is imported only when its sink opens.
"""

from __future__ import annotations

from fedge.tracking.scalars import row_scalars
from fedge.tracking.spec import SINK_KINDS, SinkSpec, TrackingError, check_tracking, parse_tracking
from fedge.tracking.tracker import Tracker

__all__ = ["SINK_KINDS", "SinkSpec", "Tracker", "TrackingError", "check_tracking", "parse_tracking", "row_scalars"]
