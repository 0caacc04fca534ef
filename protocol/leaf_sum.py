"""A leaf coordinator's sum on the wire: what a leaf sends the root for one root round.

    fedge.update   the leaf's mean, encoded with the root's uplink codec (``fedge.payload/1``);
                   absent when no device's update is in the sum
    fedge.leaf     round, leaf, codec, weight, count, planned, noised

(``fedge.aggregation.tiers`` makes and merges it.) The root checks every field before anything is
merged: the round it asked for, the codec it named, a finite weight >= 0, whole counts, and a
payload exactly when the weight is positive; anything else is a :class:`LeafSumError`, and the
leaf's reply is refused with the reason, never merged.
"""

from __future__ import annotations

import math
from typing import Any

from flwr.app import ConfigRecord, RecordDict

from fedge.protocol.records import UPDATE_RECORD, ProtocolError, payload_record, read_payload

__all__ = ["LEAF_RECORD", "LeafSumError", "leaf_sum_record", "read_leaf_sum"]

LEAF_RECORD = "fedge.leaf"
#: at most this many devices behind one leaf's sum (a count beyond it is a corrupt or lying record)
MAX_COUNT = 1 << 31


class LeafSumError(ProtocolError):
    """A leaf's sum that the root cannot merge: says which field and why."""


def leaf_sum_record(*, round: int, leaf: str, codec: str, payload: bytes, weight: float, count: int,
                    planned: int = 0, noised: bool = False) -> RecordDict:
    """The reply content a leaf sends for root round ``round``."""
    content = RecordDict({LEAF_RECORD: ConfigRecord({
        "round": int(round), "leaf": str(leaf), "codec": str(codec), "weight": float(weight), "count": int(count),
        "planned": int(planned), "noised": bool(noised)})})
    if payload:
        content[UPDATE_RECORD] = payload_record(payload)
    return content


def read_leaf_sum(content: RecordDict, *, round: int, codec: str) -> dict[str, Any]:
    """The fields of a leaf's sum for root round ``round`` encoded with ``codec`` (``round``,
    ``leaf``, ``payload``, ``weight``, ``count``, ``planned``, ``noised``), every one checked."""
    record = content.config_records.get(LEAF_RECORD)
    if record is None:
        raise LeafSumError(f"the reply has no {LEAF_RECORD!r} record")
    try:
        fields = {"round": record["round"], "leaf": record["leaf"], "codec": record["codec"],
                  "weight": record["weight"], "count": record["count"], "planned": record["planned"],
                  "noised": record["noised"]}
    except KeyError as missing:
        raise LeafSumError(f"the {LEAF_RECORD!r} record lacks {missing}") from None
    for name in ("round", "count", "planned"):
        value = fields[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
            raise LeafSumError(f"{name} must be a whole number in [0, {MAX_COUNT}], got {value!r}")
    if fields["round"] != round:
        raise LeafSumError(f"a sum for round {fields['round']} in round {round}")
    if not isinstance(fields["leaf"], str) or not fields["leaf"]:
        raise LeafSumError(f"leaf must name the leaf, got {fields['leaf']!r}")
    if fields["codec"] != codec:
        raise LeafSumError(f"encoded with {fields['codec']!r}; the root asked for {codec!r}")
    weight = fields["weight"]
    if not isinstance(weight, float) or not math.isfinite(weight) or weight < 0:
        raise LeafSumError(f"weight must be a finite number >= 0, got {weight!r}")
    if not isinstance(fields["noised"], bool):
        raise LeafSumError(f"noised must be a bool, got {fields['noised']!r}")
    has_payload = UPDATE_RECORD in content.array_records
    if has_payload != (weight > 0) or (fields["count"] == 0 and weight > 0):
        raise LeafSumError(f"a sum of weight {weight:g} over {fields['count']} updates "
                           f"{'with' if has_payload else 'without'} a payload")
    fields["payload"] = read_payload(content, UPDATE_RECORD) if has_payload else b""
    del fields["codec"]
    return fields
