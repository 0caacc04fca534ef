"""The ``tracking`` run setting: which sinks, where, and whether their library is installed.

Checked before a run starts (``check_tracking``), so a missing extra is a refusal that names the
install command, not a failure after the first round.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

__all__ = ["SINK_KINDS", "SinkSpec", "TrackingError", "check_tracking", "parse_tracking"]

#: sink kind -> (the module it needs, the extra that installs it, what its target is)
SINK_KINDS: dict[str, tuple[str, str, str]] = {
    "tensorboard": ("tensorboardX", "tensorboard", "a directory of event files (default: <run dir>/tensorboard)"),
    "mlflow": ("mlflow", "mlflow", "a tracking URI: http(s)://HOST:PORT, sqlite:///PATH, ... "
                                   "(default: sqlite:///<run dir>/mlflow.db, artifacts beside it)"),
}


class TrackingError(ValueError):
    """A ``tracking`` value names an unknown sink, or one whose library is not installed."""


@dataclass(frozen=True)
class SinkSpec:
    kind: str
    #: the sink's target as written (a directory or a URI); empty: the sink's default in the run directory
    target: str = ""


def parse_tracking(spec: str) -> list[SinkSpec]:
    """``"tensorboard;mlflow:http://127.0.0.1:5000"`` -> its sinks, in order; ``""``/``"none"`` -> none.

    ``;`` separates sinks (a URI may hold ``:`` and ``,``); each sink's target is everything after
    the first ``:``. One sink of each kind: two event writers on one run would only disagree.
    """
    sinks: list[SinkSpec] = []
    for part in (p.strip() for p in (spec or "").split(";")):
        if not part or part == "none":
            continue
        kind, _, target = part.partition(":")
        kind = kind.strip().lower()
        if kind not in SINK_KINDS:
            raise TrackingError(f"unknown tracking sink {kind!r} in {spec!r}: one of {', '.join(SINK_KINDS)} "
                                "(';' between several, e.g. 'tensorboard;mlflow:sqlite:///runs/mlflow.db')")
        if any(s.kind == kind for s in sinks):
            raise TrackingError(f"tracking {spec!r} names {kind} twice")
        sinks.append(SinkSpec(kind, target.strip()))
    return sinks


def check_tracking(spec: str) -> list[SinkSpec]:
    """:func:`parse_tracking`, and each sink's library importable here, else the command that installs it."""
    sinks = parse_tracking(spec)
    for sink in sinks:
        module, extra, _ = SINK_KINDS[sink.kind]
        if importlib.util.find_spec(module) is None:
            raise TrackingError(f"tracking {sink.kind!r} needs the {module} package, which is not installed: "
                                f"pip install 'fedge[{extra}]'")
    return sinks
