"""Behaviour unchanged: each seeded case moves the same bytes and trains the same model as when
``behaviour.json`` was recorded (before the engine's layers were refactored; see ``behaviour.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.server.behaviour import CASES, FINGERPRINTS, fingerprint

RECORDED = json.loads(FINGERPRINTS.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_seeded_runs_move_the_same_bytes_and_train_the_same_model(tmp_path, case) -> None:
    if torch.__version__ != RECORDED["torch"]:
        pytest.skip(f"fingerprints recorded with torch {RECORDED['torch']}, this is {torch.__version__}")
    got = fingerprint(case, tmp_path / "run")
    expected = RECORDED["cases"][case]
    for mine, theirs in zip(got["rows"], expected["rows"], strict=True):
        assert mine == theirs, f"{case}: round {theirs['round']} differs"
    assert got["model"] == expected["model"], f"{case}: the delivered model differs"
