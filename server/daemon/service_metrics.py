"""The daemon's ``/metrics`` (Prometheus text format, ``prometheus_client``) and ``/healthz``.

Everything is derived from what the run already writes (``metrics.jsonl`` rows, the checkpoint file)
plus the SuperLink's own node list, so the numbers a dashboard shows are the numbers in the run
directory. Failures are counted by their typed kind (``fedge.protocol.failures``), which every
``rejected`` entry of a row carries; the reasons stay free text in the rows, for people.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from fedge.launcher.http_service import HTTPService
from fedge.protocol.failures import DECLINED, FailureKind

__all__ = ["DECLINED_LABELS", "KIND_LABELS", "MetricsServer", "ServiceMetrics", "kind_label"]

#: the ``kind`` labels of ``fedge_replies_rejected``: every failure kind, ``step`` for a step-level
#: problem (an aggregate that was not finite, a secure round that could not unmask), ``other`` for a
#: kind this version does not know (a row written by another version): a closed set, so that a
#: hostile device cannot blow up the label cardinality with the text it sends
KIND_LABELS = tuple(kind.value for kind in FailureKind if not kind.declined) + ("step", "other")
#: the ``kind`` labels of ``fedge_replies_declined``: refusals by the device owner's policy
DECLINED_LABELS = tuple(sorted(kind.value for kind in DECLINED))


def kind_label(entry: dict[str, Any]) -> str:
    """One of :data:`KIND_LABELS` for a metrics row's ``rejected`` entry: its typed kind, never a
    guess from the reason's wording."""
    kind = entry.get("kind")
    if kind is None:
        return "step"
    return str(kind) if str(kind) in KIND_LABELS else "other"


class ServiceMetrics:
    """The daemon's metrics; :meth:`observe_row` once per metrics row, in order."""

    def __init__(self, checkpoint_path: Path | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rounds = Counter("fedge_rounds_completed", "Rounds (model versions) completed", registry=r)
        self.current_round = Gauge("fedge_current_round", "Last completed round (model version)", registry=r)
        self.nodes = Gauge("fedge_connected_nodes", "SuperNodes the SuperLink reports online", registry=r)
        self.replies_used = Counter("fedge_replies_used", "Client replies aggregated", registry=r)
        self.replies_rejected = Counter("fedge_replies_rejected", "Client replies rejected or missing, by kind",
                                        ["kind"], registry=r)
        self.replies_declined = Counter("fedge_replies_declined",
                                        "Devices that declined by their owner's policy, by kind", ["kind"], registry=r)
        self.uplink = Counter("fedge_uplink_bytes", "Encoded update bytes received (headers included)", registry=r)
        self.downlink = Counter("fedge_downlink_bytes", "Array bytes sent to clients", registry=r)
        self.duration = Histogram("fedge_round_duration_seconds", "Wall time of a round",
                                  buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800), registry=r)
        self.accuracy = Gauge("fedge_last_accuracy", "Held-out accuracy of the last published model", registry=r)
        self.superlink_up = Gauge("fedge_superlink_up", "1 while the SuperLink process runs", registry=r)
        self.checkpoint_age = Gauge("fedge_checkpoint_age_seconds",
                                    "Seconds since the last checkpoint was written (-1: none yet)", registry=r)
        for label in KIND_LABELS:  # every series exists from the start: rate() works at once
            self.replies_rejected.labels(kind=label)
        for label in DECLINED_LABELS:
            self.replies_declined.labels(kind=label)
        if checkpoint_path is not None:
            self.checkpoint_age.set_function(lambda: _age(checkpoint_path))

    def observe_row(self, row: dict[str, Any]) -> None:
        self.rounds.inc()
        self.current_round.set(int(row.get("round", 0)))
        self.replies_used.inc(max(0, int(row.get("clients_used", 0))))
        for item in row.get("rejected") or []:
            self.replies_rejected.labels(kind=kind_label(item)).inc()
        for kind, count in dict(row.get("declined") or {}).items():
            if kind in DECLINED_LABELS and isinstance(count, int) and count > 0:
                self.replies_declined.labels(kind=kind).inc(count)
        self.uplink.inc(max(0, int(row.get("uplink_bytes", 0))))
        self.downlink.inc(max(0, int(row.get("downlink_bytes", 0))))
        seconds = row.get("seconds")
        if isinstance(seconds, (int, float)) and seconds >= 0:
            self.duration.observe(seconds)
        accuracy = row.get("accuracy")
        if isinstance(accuracy, (int, float)) and accuracy == accuracy:
            self.accuracy.set(accuracy)


def _age(path: Path) -> float:
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return -1.0


class MetricsServer:
    """``/metrics`` and ``/healthz`` on ``host:port`` in a background thread (port 0: pick one)."""

    def __init__(self, metrics: ServiceMetrics, host: str, port: int,
                 health: Callable[[], dict[str, Any]]) -> None:
        prometheus = make_wsgi_app(metrics.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == "/healthz":
                state = health()
                body = json.dumps(state).encode()
                start_response("200 OK" if state.get("ok") else "503 Service Unavailable",
                               [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
                return [body]
            if path == "/metrics":
                return prometheus(environ, start_response)
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: try /metrics or /healthz\n"]

        self._service = HTTPService(app, host, port, name="fedge-metrics")
        self.port = self._service.port

    def start(self) -> MetricsServer:
        self._service.start()
        return self

    def stop(self) -> None:
        self._service.stop()
