"""Chaos, short: a third of the SuperNodes killed after round 1, the whole coordinator (daemon,
SuperLink, ServerApp) SIGKILLed after round 2 and restarted; the run finishes every round exactly
once with intact files. The full version with an undisturbed baseline: ``bench/chaos.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

_spec = importlib.util.spec_from_file_location("fedge_bench_chaos", Path(__file__).resolve().parents[2] / "bench" / "chaos.py")
chaos = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = chaos  # dataclasses look their module up there
_spec.loader.exec_module(chaos)  # type: ignore[union-attr]


def test_killed_nodes_and_a_coordinator_power_cut_do_not_lose_the_run(tmp_path: Path) -> None:
    result = chaos.run_chaos(tmp_path, nodes=3, rounds=3, local_epochs=5, kill_nodes_after=1,
                             kill_coordinator_after=2, wait_for_nodes=15, timeout=540)
    assert result.rounds == [1, 2, 3]  # each exactly once, every line parsed
    assert result.resumed_from == 2  # the checkpoint loaded right after the power cut
    assert result.nodes_killed == 1 and not result.scrape_errors and result.scrapes > 0
    assert not result.leftovers
    assert result.accuracy > 0.8  # two survivors finish the job (undisturbed: ~0.9 at 3 rounds here)
