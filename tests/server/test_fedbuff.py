"""FedBuff through the engine's asynchronous loop, on the in-process Grid stand-in (real ClientApp
handlers; stragglers are replies held back for a number of pulls)."""

from __future__ import annotations

import pytest
import torch

from fedge.server.algorithms.registry import check_algorithm_settings
from fedge.server.settings import RunSettings, SettingsError
from tests.server.in_process_grid import InProcessGrid
from tests.server.test_engine import _engine, _start


def test_fedbuff_with_every_client_in_the_buffer_and_no_delay_is_synchronous_fedavg(tmp_path) -> None:
    sync = _engine(tmp_path / "fedavg", rounds=3)
    expected = sync.run(InProcessGrid(3), _start(sync))
    buffered = _engine(tmp_path / "fedbuff", rounds=3, algorithm="fedbuff:concurrency=3,buffer=3")
    got = buffered.run(InProcessGrid(3), _start(buffered))
    assert [r.round for r in got.rows] == [1, 2, 3]
    assert all(r.extra["staleness_max"] == 0 and r.extra["updates_applied"] == 3 for r in got.rows)
    torch.testing.assert_close(got.model, expected.model, rtol=0, atol=1e-6)
    assert [r.uplink_bytes for r in got.rows] == [r.uplink_bytes for r in expected.rows]
    assert [r.accuracy for r in got.rows] == pytest.approx([r.accuracy for r in expected.rows], abs=0.01)


def test_a_straggler_arrives_stale_is_weighted_down_and_does_not_hold_back_versions(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=4, algorithm="fedbuff:concurrency=3,buffer=1")
    grid = InProcessGrid(3, lag={2: 3})  # partition 2 answers three pulls late
    rows = engine.run(grid, _start(engine)).rows
    assert [r.round for r in rows] == [1, 2, 3, 4]
    assert all(r.extra["updates_applied"] == 1 for r in rows)
    stale = [r for r in rows if r.extra["staleness_max"]]
    assert stale, "the straggler's update should arrive after versions were published"
    assert all(r.extra["staleness_histogram"] for r in rows)


def test_updates_staler_than_the_bound_are_dropped_and_counted(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=4, algorithm="fedbuff:concurrency=3,buffer=1,max-staleness=0")
    grid = InProcessGrid(3, lag={2: 3})
    rows = engine.run(grid, _start(engine)).rows
    dropped = sum(r.extra["dropped_stale"] for r in rows)
    assert dropped >= 1
    reasons = [x for r in rows for x in r.rejected]
    assert any(x["node"] == grid.node_id(2) and "max-staleness 0" in x["reason"] for x in reasons)
    assert all(r.extra["staleness_max"] in (0, None) for r in rows)  # nothing stale was applied


def test_resume_continues_from_the_checkpointed_version(tmp_path) -> None:
    spec = "fedbuff:concurrency=2,buffer=1"
    first = _engine(tmp_path, rounds=2, algorithm=spec)
    first.run(InProcessGrid(3), _start(first))
    more = _engine(tmp_path, rounds=4, algorithm=spec)  # same run directory, more versions
    result = more.run(InProcessGrid(3), _start(more))
    assert result.resumed_from == 2
    assert [r.round for r in result.rows] == [1, 2, 3, 4]
    assert more.algorithm.version == 4  # type: ignore[attr-defined]


def test_fedbuff_settings() -> None:
    check_algorithm_settings(RunSettings(algorithm="fedbuff", server_opt="fedadam", aggregator="median"))  # FedAvg's keys
    check_algorithm_settings(RunSettings(algorithm="fedbuff", downlink_codec="lattice"))  # versioned copies
    with pytest.raises(SettingsError, match="prox-mu"):
        check_algorithm_settings(RunSettings(algorithm="easgd", prox_mu=0.1))
    from fedge.server.preflight import preflight

    with pytest.raises(ValueError, match="exceeds clients-per-round"):
        preflight(RunSettings(algorithm="fedbuff:concurrency=20", clients_per_round=10))
    with pytest.raises(ValueError, match="unknown staleness"):
        preflight(RunSettings(algorithm="fedbuff:staleness=linear"))
