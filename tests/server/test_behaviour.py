"""Behaviour unchanged: each seeded case moves the same bytes and trains the same model as when
``behaviour.json`` was recorded (before the engine's layers were refactored; see ``behaviour.py``)."""

from __future__ import annotations

import pytest

from tests.server.behaviour import CASES, fingerprint, recorded_here


@pytest.mark.parametrize("case", sorted(CASES))
def test_seeded_runs_move_the_same_bytes_and_train_the_same_model(tmp_path, case) -> None:
    expected = recorded_here()[case]
    got = fingerprint(case, tmp_path / "run")
    for mine, theirs in zip(got["rows"], expected["rows"], strict=True):
        assert mine == theirs, f"{case}: round {theirs['round']} differs"
    assert got["model"] == expected["model"], f"{case}: the delivered model differs"
