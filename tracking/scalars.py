"""What of a ``metrics.jsonl`` row a tracking sink logs: every finite number in it, by a flat name.

The row is the record; the sinks show the same figures, so a reader of either sees one run. Nested
objects are flattened with ``/`` (``device_resources/rss_mb``: TensorBoard and MLflow both group
by it), lists are left out except the row's refusals, which are counted by their typed kind
(``rejected/timeout``: the same kinds the daemon's ``/metrics`` counts), and the compression ratio is
added (fp32 bytes the used replies would have cost over what they did cost).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

__all__ = ["row_scalars"]

#: not figures: the step itself (the sinks' step axis) and names the row repeats as text
_SKIPPED = {"round"}


def row_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The flat ``name -> value`` figures of one row (``round`` is the step, not a figure)."""
    scalars: dict[str, float] = {}
    _flatten(scalars, "", {k: v for k, v in row.items() if k not in _SKIPPED})
    uplink, fp32 = row.get("uplink_bytes"), row.get("uplink_fp32_bytes")
    if _is_number(uplink) and _is_number(fp32) and uplink > 0:
        scalars["compression_ratio"] = float(fp32) / float(uplink)
    kinds = Counter(str(entry.get("kind") or "other") for entry in row.get("rejected") or []
                    if isinstance(entry, dict))
    for kind, count in kinds.items():
        scalars[f"rejected/{kind}"] = float(count)
    return scalars


def _flatten(out: dict[str, float], prefix: str, value: dict[str, Any]) -> None:
    for key, inner in value.items():
        name = f"{prefix}{key}"
        if isinstance(inner, dict):
            _flatten(out, f"{name}/", inner)
        elif _is_number(inner) and math.isfinite(float(inner)):
            out[name] = float(inner)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
