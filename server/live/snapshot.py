"""One JSON object of what a run directory says now: settings, rounds, devices, leaves.

Read from the files the run writes (``config.json``, ``metrics.jsonl``, ``devices.json``,
``summary.json``, ``leaf-*/``), so the page shows the numbers the run directory holds. A
:class:`Snapshots` re-reads only files that changed (size and modification time), so a page that
polls an idle run costs a few ``stat`` calls.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedge.server.run.metrics_log import MetricsLog

__all__ = ["ROW_FIELDS", "Snapshots", "series_row"]

#: what the page draws and lists of each row (the rest stays in metrics.jsonl)
ROW_FIELDS = ("round", "loss", "train_loss", "uplink_bytes", "uplink_fp32_bytes", "downlink_bytes", "clients_sampled",
              "clients_used", "clients_failed", "clients_declined", "seconds", "wall_seconds", "dp_epsilon",
              "staleness_mean", "staleness_max", "metric", "evaluation")


def series_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row as the page reads it: its figures, its primary metric's value as ``score``, and its
    refusals counted by typed kind."""
    out = {k: row[k] for k in ROW_FIELDS if k in row}
    metric = row.get("metric", "accuracy")
    out["score"] = row.get(metric)
    kinds: dict[str, int] = {}
    for entry in row.get("rejected") or []:
        kind = str(entry.get("kind") or "step") if isinstance(entry, dict) else "other"
        kinds[kind] = kinds.get(kind, 0) + 1
    out["refusals"] = kinds
    out["declined"] = row.get("declined") or {}
    return out


class _File:
    """A file re-read only when its size or modification time changed."""

    def __init__(self, path: Path, read: Callable[[Path], Any], empty: Any) -> None:
        self.path, self.read, self.empty = path, read, empty
        self.stamp: tuple[int, int] | None = None
        self.value = empty

    def get(self) -> Any:
        try:
            stat = os.stat(self.path)
        except OSError:
            self.stamp, self.value = None, self.empty
            return self.value
        stamp = (stat.st_size, stat.st_mtime_ns)
        if stamp != self.stamp:
            try:
                self.value = self.read(self.path)
                self.stamp = stamp
            except (OSError, ValueError):  # mid-write (atomic files never are) or gone: keep the last
                pass
        return self.value


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _rows(path: Path) -> list[dict[str, Any]]:
    return [series_row(r) for r in MetricsLog(path).read()]


class _Run:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = _File(path / "config.json", _json, {})
        self.rows = _File(path / "metrics.jsonl", _rows, [])
        self.devices = _File(path / "devices.json", _json, {})
        self.summary = _File(path / "summary.json", _json, None)

    def read(self) -> dict[str, Any]:
        config, devices = self.config.get(), self.devices.get()
        listed = list((devices.get("devices") or {}).values()) if isinstance(devices, dict) else []
        # node ids are 64-bit: as JSON numbers a browser would round them (2^53), so they go as text
        return {"name": self.path.name, "settings": config.get("settings", {}) if isinstance(config, dict) else {},
                "started_at": config.get("started_at") if isinstance(config, dict) else None,
                "rows": self.rows.get(), "summary": self.summary.get(),
                "devices": [{**d, "node": str(d.get("node"))} for d in listed if isinstance(d, dict)]}


class Snapshots:
    """The run in ``run_dir`` (and its leaves), and ``online()``: the SuperLink's node list when
    there is one (``[{"node-id": "7", "status": "online", ...}]``, Flower's ``supernode ls``)."""

    def __init__(self, run_dir: Path, online: Callable[[], list[dict[str, Any]] | None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.online = online or (lambda: None)
        self._runs: dict[Path, _Run] = {}

    def _run(self, path: Path) -> _Run:
        if path not in self._runs:
            self._runs[path] = _Run(path)
        return self._runs[path]

    def snapshot(self) -> dict[str, Any]:
        root = self._run(self.run_dir).read()
        online = self.online()
        if online is not None:
            status = {str(n.get("node-id")): n for n in online}
            for device in root["devices"]:
                known = status.pop(str(device.get("node")), None)
                device["status"] = known.get("status") if known else "unknown"
            root["devices"] += [{"node": k, "rounds": 0, "status": v.get("status")}
                                for k, v in status.items()]  # connected, never asked yet
        leaves = []
        for path in sorted(p for p in self.run_dir.glob("leaf-*") if p.is_dir()):
            leaf = self._run(path).read()
            last = leaf["rows"][-1] if leaf["rows"] else {}
            leaves.append({"name": leaf["name"], "round": last.get("round", 0), "score": last.get("score"),
                           "metric": last.get("metric"), "clients_used": last.get("clients_used"),
                           "devices": len(leaf["devices"]), "devices_list": leaf["devices"]})
        root["leaves"] = leaves
        root["online_known"] = online is not None
        return root

    def body(self) -> tuple[bytes, str]:
        """The snapshot as JSON bytes and its ETag (the page asks again only for a changed one)."""
        body = json.dumps(self.snapshot(), separators=(",", ":"), allow_nan=False, default=str).encode()
        return body, '"' + hashlib.blake2b(body, digest_size=12).hexdigest() + '"'
