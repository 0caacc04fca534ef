"""The door every client reply passes before any algorithm sees it: shape of the whole message.

Algorithms and codecs validate what they read (payload headers, lengths, finiteness, metrics they
use). This screen refuses what none of them would look at: records the protocol does not define
(a client must not be able to smuggle state or probe parsers through names nobody checks), a reply
far larger than any legitimate one (checked before anything is decoded), and metric values that
are not finite numbers. Each refusal is a :class:`Rejected` with the reason, which the engine logs,
records in the metrics row and the daemon counts by kind (``fedge_replies_rejected_total{kind="invalid"}``).
"""

from __future__ import annotations

import math

from flwr.app import RecordDict

from fedge.protocol import CONTROL_RECORD, MEASURE_RECORD, METRICS_RECORD, UPDATE_RECORD, array_bytes
from fedge.protocol.resources import RESOURCES_RECORD
from fedge.server.engine.algorithm import Rejected

__all__ = ["ALLOWED_RECORDS", "max_reply_bytes", "screen_reply"]

#: Every record name a train reply may carry (edge_client/local.py ``train_reply``; the device's
#: resource report, ``fedge.protocol.resources``, added by its ``resource_mod``).
ALLOWED_RECORDS = frozenset({UPDATE_RECORD, METRICS_RECORD, MEASURE_RECORD, RESOURCES_RECORD, CONTROL_RECORD})


def max_reply_bytes(fp32_model_bytes: int) -> int:
    """The most array bytes a reply can legitimately hold: an uncompressed update plus the exact
    model of a measuring step, with headroom for codec headers."""
    return 2 * fp32_model_bytes + (1 << 20)


def screen_reply(content: RecordDict, fp32_model_bytes: int) -> None:
    unknown = sorted(set(content.keys()) - ALLOWED_RECORDS)
    if unknown:
        raise Rejected(f"unknown record names {unknown[:5]}; a reply carries only {sorted(ALLOWED_RECORDS)}")
    size, limit = array_bytes(content), max_reply_bytes(fp32_model_bytes)
    if size > limit:
        raise Rejected(f"oversized reply: {size} array bytes > {limit} (twice the fp32 model + 1 MiB)")
    for record in content.metric_records.values():
        for key, value in record.items():
            values = value if isinstance(value, list) else [value]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
                raise Rejected(f"metric {key!r} is not a finite number: {value!r}"[:200])
