"""The typed metrics row: the fields every algorithm writes, the task's metrics, and extras.

One row per step goes to ``metrics.jsonl`` as a flat JSON object: the common fields, the held-out
metrics of the step's model (``loss`` and the task's own, e.g. ``accuracy`` or ``mse``; their
names listed in ``metrics``, the one that drives progress, plot and stop rule in ``metric``, and
where they were measured in ``evaluation``), then the algorithm's extras (EASGD's
``center_distance``, gossip's ``consensus_distance``). So ``jq .accuracy`` works the same for every
algorithm. The progress display, the plot and the summary read only the common fields and the
metrics, through :class:`RoundRow`; neither an extra nor a metric can shadow a common field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TIMING_FIELDS", "RoundRow", "without_timing"]

#: the fields of a row that measure time (the step's, the run's, the devices' own): everything else
#: in a row of a synchronous run is the same, bit for bit, in every run of one seed and one setting
TIMING_FIELDS = frozenset({"seconds", "wall_seconds", "client_train_seconds", "client_idle_seconds",
                           "device_resources"})


def without_timing(row: dict[str, Any]) -> dict[str, Any]:
    """A ``metrics.jsonl`` row less its :data:`TIMING_FIELDS`: what two runs of one seed compare."""
    return {k: v for k, v in row.items() if k not in TIMING_FIELDS}


@dataclass
class RoundRow:
    round: int
    algorithm: str
    train_loss: float | None
    uplink_bytes: int  # real encoded update bytes of used replies, headers included
    uplink_fp32_bytes: int  # what the same replies would have cost as fp32 ArrayRecords
    downlink_bytes: int  # array bytes of every message sent (models, payloads, public copies)
    seconds: float  # this step's duration
    clients_sampled: int
    clients_used: int
    clients_failed: int
    codec: str
    #: held-out metrics of the step's model (global / center / average): ``loss`` plus the task's
    metrics: dict[str, float] = field(default_factory=dict)
    #: the metric that drives progress, the plot and the stop rule (a key of ``metrics``)
    metric: str = "accuracy"
    #: where ``metrics`` were measured: ``central`` (the coordinator's held-out data) or
    #: ``federated`` (the devices' local held-out splits, example-weighted)
    evaluation: str = "central"
    measurement_bytes: int = 0  # uploads for measurement only (gossip's exact node models)
    #: devices that declined the step by their owner's policy (``not-eligible``, ``over-budget``):
    #: not failures, not in ``clients_failed``
    clients_declined: int = 0
    rejected: list[dict[str, Any]] = field(default_factory=list)
    #: since the run's first message, across restarts (downtime not counted); set when published.
    #: Synchronous and asynchronous runs compare on this axis (time to a target accuracy).
    wall_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def score(self) -> float:
        """The primary metric's value (NaN when the step was not evaluated)."""
        return float(self.metrics.get(self.metric, math.nan))

    @property
    def loss(self) -> float:
        return float(self.metrics.get("loss", math.nan))

    @property
    def accuracy(self) -> float:
        """Held-out accuracy (NaN for a task without one)."""
        return float(self.metrics.get("accuracy", math.nan))

    def to_json(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "metrics")}
        row["metrics"] = list(self.metrics)
        for name, other in (("metrics", self.metrics), ("extras", self.extra)):
            clash = set(row) & set(other)
            if clash:
                raise ValueError(f"{name} {sorted(clash)} would overwrite common fields")
        clash = set(self.metrics) & set(self.extra)
        if clash:
            raise ValueError(f"extras {sorted(clash)} would overwrite metrics")
        return {**row, **self.metrics, **self.extra}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RoundRow:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "metrics"}
        raw = dict(raw)
        # rows written before tasks had their own metrics: loss and accuracy were common fields
        metric_names = raw.pop("metrics", None) or [k for k in ("loss", "accuracy") if k in raw]
        metrics = {k: raw.pop(k) for k in metric_names if k in raw}
        common = {k: v for k, v in raw.items() if k in names}
        common.setdefault("algorithm", "fedavg")  # rows written before algorithms existed
        common.setdefault("measurement_bytes", 0)
        return cls(**common, metrics=metrics, extra={k: v for k, v in raw.items() if k not in names})
