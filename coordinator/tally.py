"""The reply accounting of one step, for its metrics row: the same for a synchronous round, a
secure round and an asynchronous version.

``uplink`` counts what every reply that arrived brought (:meth:`Tally.replied`, used or refused:
the real encoded payloads, headers included; its ``update`` record, or a model a Flower app's node
sent) plus what layers exchanged on their own (secure aggregation's key agreement);
``measurement`` the ``measure`` records; ``downlink`` every array sent (and layers' own messages).
Every driver counts through it, so one reply is the same bytes in each coordinator's metrics.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flwr.app import Message

from fedge.protocol import CONTROL_RECORD, MEASURE_RECORD, METRICS_RECORD, UPDATE_RECORD, array_bytes
from fedge.protocol.resources import ResourceReport, report_of

from fedge.protocol.failures import Failure

if TYPE_CHECKING:
    from fedge.coordinator.step import Outgoing

__all__ = ["Tally", "resource_summary", "train_seconds"]


@dataclass
class Tally:
    began: float
    sampled: int = 0  # messages sent (asynchronous: dispatched while this version was built)
    used: int = 0
    #: the nodes of the used replies, in the order they landed
    members: list[int] = field(default_factory=list)
    uplink: int = 0
    #: replies that brought an upload (an update or a model; used or refused): what ``uplink`` is the
    #: bytes of, and so what its fp32 baseline counts
    uploads: int = 0
    measurement: int = 0
    downlink: int = 0
    idle: float = 0.0  # asynchronous: node-seconds between a node's reply and its next message
    train_seconds: list[float] = field(default_factory=list)  # clients' own training time
    #: devices' resource reports (every reply that carried a valid one, used or not)
    resources: list[ResourceReport] = field(default_factory=list)
    #: the same reports by the node that sent them (the run's device ledger keeps each device's last)
    reports: dict[int, ResourceReport] = field(default_factory=dict)
    #: (node, kind) of every device that declined by its owner's policy
    declined_nodes: list[tuple[int | None, str]] = field(default_factory=list)
    rejected: list[dict[str, object]] = field(default_factory=list)
    #: failures by kind (``Failure.kind``): timeouts, client errors, refused replies, device refusals
    failures: Counter[str] = field(default_factory=Counter)
    #: devices that declined by their owner's policy (not eligible now, over budget), by kind: not failures
    declined: Counter[str] = field(default_factory=Counter)
    #: step-level problems (a secure round that could not be unmasked, a non-finite aggregate)
    notes: list[dict[str, object]] = field(default_factory=list)

    def sent(self, outgoing: list[Outgoing]) -> None:
        self.sampled += len(outgoing)
        self.downlink += sum(array_bytes(o.content) for o in outgoing)

    def replied(self, reply: Message) -> None:
        """A reply arrived (before the door decides on it): its bytes and its resource report."""
        if reply.has_error():
            return
        records = reply.content.array_records
        uploaded = ((UPDATE_RECORD, CONTROL_RECORD) if UPDATE_RECORD in records  # SCAFFOLD's dc_i beside an update
                    else tuple(n for n in records if n != MEASURE_RECORD))
        self.uplink += array_bytes(reply.content, uploaded)
        self.uploads += bool(uploaded)
        self.measurement += array_bytes(reply.content, (MEASURE_RECORD,))
        report = report_of(reply)
        if report is not None:
            self.resources.append(report)
            self.reports[reply.metadata.src_node_id] = report

    def failed(self, failure: Failure) -> None:
        if failure.kind.declined:
            self.declined[failure.kind.value] += 1
            self.declined_nodes.append((failure.node, failure.kind.value))
            return
        self.rejected.append(failure.entry())
        self.failures[failure.kind.value] += 1

    def by_kind(self, failed: str = "failures", declined: str = "declined") -> dict[str, dict[str, int]]:
        """The step's failures and its devices' policy declines (not failures), each by kind, under
        the names a driver's metrics give them (the engine's row; a Flower app's ``fedge-failed``)."""
        counts = {failed: dict(sorted(self.failures.items())), declined: dict(sorted(self.declined.items()))}
        return {name: by_kind for name, by_kind in counts.items() if by_kind}

    def app_metrics(self) -> dict[str, object]:
        """What a Flower-app driver adds to a step's metrics from its tally: ``fedge-failed`` and
        ``fedge-declined`` by kind, and ``fedge-device-resources`` (empty when no device reported)."""
        return {**self.by_kind("fedge-failed", "fedge-declined"),
                "fedge-device-resources": resource_summary(self.resources)}


def train_seconds(reply: Message) -> float:
    """A reply's own ``train-seconds`` (a number >= 0), or 0 when it sent none or nonsense: it is
    reported, never trusted for anything else."""
    metrics = reply.content.metric_records.get(METRICS_RECORD)
    value = metrics.get("train-seconds", 0.0) if metrics is not None else 0.0
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 else 0.0


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def resource_summary(reports: list[ResourceReport]) -> dict[str, object]:
    """Median and 95th percentile (nearest rank) of each field over the step's devices' reports."""
    if not reports:
        return {}
    summary: dict[str, object] = {"devices": len(reports)}
    for name in ResourceReport.__dataclass_fields__:
        values = [getattr(r, name) for r in reports]
        summary[name] = {"median": statistics.median(values), "p95": _nearest_rank(values, 0.95)}
    return summary
