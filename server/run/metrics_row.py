"""The typed metrics row: the fields every algorithm writes, plus its own extras.

One row per step goes to ``metrics.jsonl`` as a flat JSON object (the common fields, then the
algorithm's extras, e.g. EASGD's ``center_distance`` or gossip's ``consensus_distance``), so
``jq .accuracy`` works the same for every algorithm. The progress display, the plot and the summary
read only the common fields, through :class:`RoundRow`; an extra can never shadow a common field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RoundRow"]


@dataclass
class RoundRow:
    round: int
    algorithm: str
    accuracy: float  # held-out accuracy of the step's model (global / center / average)
    loss: float
    train_loss: float | None
    uplink_bytes: int  # real encoded update bytes of used replies, headers included
    uplink_fp32_bytes: int  # what the same replies would have cost as fp32 ArrayRecords
    downlink_bytes: int  # array bytes of every message sent (models, payloads, public copies)
    seconds: float  # this step's duration
    clients_sampled: int
    clients_used: int
    clients_failed: int
    codec: str
    measurement_bytes: int = 0  # uploads for measurement only (gossip's exact node models)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    #: since the run's first message, across restarts (downtime not counted); set when published.
    #: Synchronous and asynchronous runs compare on this axis (time to a target accuracy).
    wall_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        clash = set(row) & set(self.extra)
        if clash:
            raise ValueError(f"metrics extras {sorted(clash)} would overwrite common fields")
        return {**row, **self.extra}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RoundRow:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        common = {k: v for k, v in raw.items() if k in names}
        common.setdefault("algorithm", "fedavg")  # rows written before algorithms existed
        common.setdefault("measurement_bytes", 0)
        return cls(**common, extra={k: v for k, v in raw.items() if k not in names})
