"""End to end: the demo configuration trains to the accuracy the README claims (slow: ~2 minutes)."""

from __future__ import annotations

import pytest

from fedge.server.local import launch
from fedge.server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def test_demo_reaches_95_percent_and_matches_fp32(tmp_path, assert_no_leftovers) -> None:
    results = {}
    for codec in ("qsgd:bits=4,bucket=512,norm=max", "none"):
        settings = RunSettings(codec=codec, run_dir=str(tmp_path / codec.split(":")[0]))
        result = launch(settings, engine="simulation", num_supernodes=10, timeout=800)
        assert_no_leftovers(result.run_dir / "flwr-home")
        results[codec] = result.summary
    q4, fp32 = results["qsgd:bits=4,bucket=512,norm=max"], results["none"]
    assert q4["final_accuracy"] >= 0.95
    assert abs(q4["final_accuracy"] - fp32["final_accuracy"]) <= 0.015
    assert q4["uplink_fp32_bytes"] / q4["uplink_bytes"] >= 6.0
