"""The reply accounting of one step, for its metrics row: the same for a synchronous round, a
secure round and an asynchronous version.

``uplink`` counts the ``update`` record of every used reply (the real encoded payloads, headers
included) plus what layers exchanged on their own (secure aggregation's key agreement);
``measurement`` the ``measure`` records; ``downlink`` every array sent (and layers' own messages).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from flwr.app import Message

from fedge.protocol import METRICS_RECORD, array_bytes
from fedge.server.engine.algorithm import Outgoing
from fedge.server.engine.layers.base import Failure

__all__ = ["Tally", "train_seconds"]


@dataclass
class Tally:
    began: float
    sampled: int = 0  # messages sent (asynchronous: dispatched while this version was built)
    used: int = 0
    uplink: int = 0
    measurement: int = 0
    downlink: int = 0
    idle: float = 0.0  # asynchronous: node-seconds between a node's reply and its next message
    train_seconds: list[float] = field(default_factory=list)  # clients' own training time
    rejected: list[dict[str, object]] = field(default_factory=list)
    #: failures by kind (``Failure.kind``): timeouts, client errors, refused replies, device refusals
    failures: Counter[str] = field(default_factory=Counter)
    #: step-level problems (a secure round that could not be unmasked, a non-finite aggregate)
    notes: list[dict[str, object]] = field(default_factory=list)

    def sent(self, outgoing: list[Outgoing]) -> None:
        self.sampled += len(outgoing)
        self.downlink += sum(array_bytes(o.content) for o in outgoing)

    def failed(self, failure: Failure) -> None:
        self.rejected.append(failure.entry())
        self.failures[failure.kind] += 1


def train_seconds(reply: Message) -> float:
    """A reply's own ``train-seconds`` (a number >= 0), or 0 when it sent none or nonsense: it is
    reported, never trusted for anything else."""
    metrics = reply.content.metric_records.get(METRICS_RECORD)
    value = metrics.get("train-seconds", 0.0) if metrics is not None else 0.0
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 else 0.0
