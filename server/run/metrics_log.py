"""Per-round metrics as JSON lines (``metrics.jsonl``): one self-contained object per round.

Each line is written with a single ``write`` and fsynced, so a crash can lose at most the line being
written, never corrupt earlier ones. On resume, rows after the checkpoint's round are dropped
(atomically) because those rounds will run again.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from fedge.deploy.atomic import atomic_write_text

__all__ = ["MetricsLog"]

log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(self, row: dict[str, Any]) -> None:
        # NaN/inf (a diverged loss) become null: strict JSON, and a bad round never stops the log.
        line = json.dumps(_finite_or_null(row), allow_nan=False) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() > 0:
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":  # a torn line from a crash: never glue a row onto it
                    line = "\n" + line
            handle.write(line.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())

    def read(self) -> list[dict[str, Any]]:
        """All complete rows; a torn last line (crash mid-write) is skipped with a warning."""
        if not self.path.exists():
            return []
        rows = []
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s line %d is incomplete and ignored", self.path, number)
        return rows

    def truncate_after(self, last_round: int) -> None:
        rows = self.read()
        kept = [r for r in rows if int(r.get("round", 0)) <= last_round]
        if len(kept) != len(rows) or (self.path.exists() and not self._well_formed()):
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def _well_formed(self) -> bool:
        text = self.path.read_text(encoding="utf-8")
        return text == "" or text.endswith("\n")


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value
