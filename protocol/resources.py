"""A device's resource report: what one message cost the device, carried in its reply.

Edge devices pay for every CPU-second and megabyte; an operator needs to see that cost per device
and per round, and a system-aware selection needs each device's speed. The device's
``resource_mod`` (``fedge.edge_client.resources``) writes one ``resources`` MetricRecord into each
reply; the coordinator reads it with :func:`read_report` (validated: finite, non-negative, bounded)
and its metrics row gets the median and 95th percentile over the step's devices.

CPU is split into ``train`` (local training), ``encode`` (compression, error feedback, masking) and
``overhead`` (everything else this message cost the process: its start, imports, installing the
app, decoding the model, Flower's own work). ``startup`` is the part of the overhead spent before
the ClientApp got the message (a fresh ``flwr-clientapp`` process's imports; a warm child's fork).
Bytes are Flower's serialized objects of the message as received and of the reply as sent (the
report's own fixed-size doubles included).

Like ``train-seconds``, the report is a timing side channel (training time grows with a device's
data); it is not covered by a DP guarantee. A device can leave it out (node config
``resource-report=false``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from flwr.app import Message, MetricRecord, RecordDict

__all__ = ["RESOURCES_RECORD", "ResourceReport", "read_report"]

#: the record a reply's report travels in
RESOURCES_RECORD = "resources"

#: values beyond these are not a device's honest report (a day of CPU, a TiB of memory or traffic)
_LIMITS = {"seconds": 86_400.0, "bytes": float(1 << 40), "mib": float(1 << 20)}


@dataclass(frozen=True)
class ResourceReport:
    """One message's cost on the device that ran it."""

    cpu_seconds: float  # the process's user + system CPU for this message, start to reply
    train_cpu_seconds: float
    encode_cpu_seconds: float
    overhead_cpu_seconds: float  # cpu - train - encode
    startup_cpu_seconds: float  # before the ClientApp got the message (part of the overhead)
    wall_seconds: float  # the process's life until the reply was built
    peak_rss_mib: float
    bytes_down: float
    bytes_up: float

    def record(self) -> MetricRecord:
        return MetricRecord({name.replace("_", "-"): float(value) for name, value in asdict(self).items()})

    def with_bytes_up(self, value: int) -> ResourceReport:
        return ResourceReport(**{**asdict(self), "bytes_up": float(value)})


def _limit(name: str) -> float:
    if name.endswith("seconds"):
        return _LIMITS["seconds"]
    return _LIMITS["mib"] if name.endswith("mib") else _LIMITS["bytes"]


def read_report(content: RecordDict) -> ResourceReport | None:
    """The reply's report, or None when it carries none or one that is malformed (missing field,
    non-finite, negative or absurd value). A report is shown in the rows. ``selection=oort`` also
    reads its wall time, but only within bounds set by the coordinator's own clock
    (``fedge.coordinator.selection_layer``)."""
    record = content.metric_records.get(RESOURCES_RECORD)
    if record is None:
        return None
    values: Mapping[str, object] = record
    parsed: dict[str, float] = {}
    for field in fields(ResourceReport):
        value = values.get(field.name.replace("_", "-"))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        value = float(value)
        if not math.isfinite(value) or not 0.0 <= value <= _limit(field.name):
            return None
        parsed[field.name] = value
    return ResourceReport(**parsed)


def report_of(reply: Message) -> ResourceReport | None:
    """:func:`read_report` of a reply that has content (an error reply has none)."""
    return None if reply.has_error() else read_report(reply.content)
