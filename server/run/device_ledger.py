"""``devices.json``: each device of the run as the coordinator has seen it, for people watching.

One entry per node that was ever sent a message: the rounds it took part in (its update was used),
the last round it was asked and the last it answered, when that was (wall time), its refusals and
its owner's declines by typed kind, and the last resource report it sent. The engine records each
published step and rewrites the file atomically; a resumed run loads it and goes on. It is a
monitoring record, not part of the run's result: ``metrics.jsonl`` is the record, and two runs of
one seed differ here only in times and Flower's node numbers.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedge.deploy.atomic import atomic_write_text
from fedge.coordinator.tally import Tally

__all__ = ["DeviceLedger"]

log = logging.getLogger(__name__)


class DeviceLedger:
    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.devices: dict[str, dict[str, Any]] = self._load()

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:  # a monitoring file: start it again rather than stop the run
            log.warning("%s is unreadable (%s); the device ledger starts again", self.path, err)
            return {}
        devices = data.get("devices") if isinstance(data, dict) else None
        return {str(k): v for k, v in devices.items() if isinstance(v, dict)} if isinstance(devices, dict) else {}

    def record(self, step: int, asked: Iterable[int], tally: Tally, name: Callable[[int], int | None]) -> None:
        """One published step: ``asked`` are the nodes sent a message, ``tally`` what came of it;
        ``name`` gives a node's partition (the same device across restarts of a simulation)."""
        now = self.clock()
        used = set(tally.members)
        answered = used | set(tally.reports)
        for node in {*asked, *answered}:
            entry = self._entry(node, name)
            entry["last_asked"] = max(entry.get("last_asked", 0), step)
            if node in answered:
                entry["last_round"], entry["last_seen"] = step, now
            if node in used:
                entry["rounds"] = entry.get("rounds", 0) + 1
            if node in tally.reports:
                entry["resources"] = asdict(tally.reports[node])
        for item in tally.rejected:
            node = item.get("node")
            if isinstance(node, int):
                kinds = self._entry(node, name).setdefault("refusals", {})
                kinds[str(item.get("kind"))] = kinds.get(str(item.get("kind")), 0) + 1
        for node, kind in tally.declined_nodes:
            if node is not None:
                kinds = self._entry(node, name).setdefault("declined", {})
                kinds[kind] = kinds.get(kind, 0) + 1
        atomic_write_text(self.path, json.dumps({"step": step, "written_at": now, "devices": self.devices},
                                                separators=(",", ":")) + "\n")

    def _entry(self, node: int, name: Callable[[int], int | None]) -> dict[str, Any]:
        entry = self.devices.setdefault(str(node), {"node": node, "rounds": 0})
        partition = name(node)
        if partition is not None:
            entry["partition"] = partition
        return entry
