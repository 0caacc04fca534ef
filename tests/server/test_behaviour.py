"""Behaviour unchanged: each seeded case moves the same bytes and trains the same model as when
``behaviour.json`` was recorded (before the engine's layers were refactored; see ``behaviour.py``)."""

from __future__ import annotations

import pytest

from tests.server.behaviour import CASES, fingerprint, recorded_for, recorded_here


@pytest.mark.parametrize("case", sorted(CASES))
def test_seeded_runs_move_the_same_bytes_and_train_the_same_model(tmp_path, case) -> None:
    expected = recorded_here()[case]
    got = fingerprint(case, tmp_path / "run")
    for mine, theirs in zip(got["rows"], expected["rows"], strict=True):
        assert mine == theirs, f"{case}: round {theirs['round']} differs"
    assert got["model"] == expected["model"], f"{case}: the delivered model differs"


def test_each_platform_is_checked_against_its_own_recorded_set() -> None:
    """A set names the platform it was recorded on; one recorded before platforms were named (its
    vendor only) stands for that vendor's CPUs; a platform with no set gets none (the test skips)."""
    legacy = {"platform": {"torch": "2.13.0+cpu", "cpu_vendor": "AuthenticAMD"}, "cases": {"a": 1}}
    intel = {"platform": {"torch": "2.13.0+cpu", "cpu_vendor": "GenuineIntel", "cpu_capability": "AVX512"},
             "cases": {"a": 2}}
    recorded = {"platforms": [legacy, intel]}
    here = {"torch": "2.13.0+cpu", "cpu_vendor": "GenuineIntel", "cpu_capability": "AVX512"}
    assert recorded_for(recorded, here) is intel
    assert recorded_for(recorded, {**here, "cpu_capability": "AVX2"}) is None
    assert recorded_for(recorded, {**here, "cpu_vendor": "AuthenticAMD", "cpu_capability": "AVX2"}) is legacy
    assert recorded_for(recorded, {**here, "torch": "2.14.1+cpu"}) is None
    amd_avx2 = {"platform": {"torch": "2.13.0+cpu", "cpu_vendor": "AuthenticAMD", "cpu_capability": "AVX2"},
                "cases": {"a": 3}}
    recorded["platforms"].append(amd_avx2)  # a platform's own set wins over its vendor's legacy one
    assert recorded_for(recorded, {**here, "cpu_vendor": "AuthenticAMD", "cpu_capability": "AVX2"}) is amd_avx2
    assert recorded_for(recorded, {**here, "cpu_vendor": "AuthenticAMD", "cpu_capability": "AVX512"}) is legacy
