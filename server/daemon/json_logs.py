"""JSON-lines logging for the daemon: one object per event, ready for journald, Loki or jq.

``log.info("round done", extra=fields(run=7, round=3, accuracy=0.95))`` becomes
``{"ts": "2026-11-23T12:00:00.123Z", "level": "info", "logger": "fedge.serve", "event": "round done",
"run": 7, "round": 3, "accuracy": 0.95}``. Fields ride in one ``extra`` key so they can never collide
with ``LogRecord``'s own attributes.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import Any

__all__ = ["JsonFormatter", "configure_json_logging", "fields"]

_KEY = "fedge_fields"


def fields(**values: Any) -> dict[str, Any]:
    return {_KEY: values}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = dt.datetime.fromtimestamp(record.created, dt.timezone.utc)
        event: dict[str, Any] = {
            "ts": stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        event.update(getattr(record, _KEY, {}) or {})
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str)


def configure_json_logging(level: int = logging.INFO, stream: Any = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
