"""Beyond one SuperLink on Flower's own processes: a root SuperLink whose two nodes are bridges,
each to a leaf (a SuperLink of its own, two device SuperNodes, a leaf coordinator's run), all on
127.0.0.1; the root's rounds train the leaves' devices, a killed root resumes, and every process
stops at the end."""

from __future__ import annotations

import json

import pytest

from fedge.server.local import launch
from fedge.server.run.checkpoint import CheckpointStore
from fedge.server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


@pytest.mark.timeout(800)
def test_a_killed_root_resumes_from_its_checkpoint_and_the_leaves_from_theirs(tmp_path, assert_no_leftovers) -> None:
    """The root's rounds train the leaves' devices, and a crash loses nothing: every process of the
    root is SIGKILLed after its round 2 and the leaves are stopped. Started again on the same run
    directory, the root resumes from its checkpoint and the leaves from theirs: the root's rows are
    rounds 1-4 once each, each with both leaves, and each leaf stepped each root round once with
    its two devices (a round a leaf had already answered before the crash is answered from its
    spool, not stepped again). Every process stops at the end."""
    settings = RunSettings(rounds=4, clients_per_round=2, local_epochs=1, run_dir=str(tmp_path / "run"),
                           wait_for_nodes=120.0)
    crashed = launch(settings, engine="deployment", num_supernodes=4, leaves=2, stop_after_round=2, timeout=360)
    assert crashed.summary is None
    saved = CheckpointStore(crashed.run_dir / "checkpoint").load()
    assert saved is not None and saved.round in (1, 2, 3)
    resumed = launch(settings, engine="deployment", num_supernodes=4, leaves=2, timeout=360)
    assert [r["round"] for r in resumed.rows] == [1, 2, 3, 4]
    assert resumed.summary is not None and resumed.summary["resumed_from_round"] == saved.round
    assert all(r["clients_used"] == 2 and not r["rejected"] for r in resumed.rows), resumed.rows
    assert resumed.summary["final_accuracy"] > resumed.summary["initial_accuracy"]
    for leaf in ("leaf-0", "leaf-1"):
        rows = [json.loads(line) for line in (tmp_path / "run" / leaf / "metrics.jsonl").read_text().splitlines()]
        assert sorted({r["round"] for r in rows}) == [1, 2, 3, 4], rows
        assert len(rows) == len({r["round"] for r in rows}), [r["round"] for r in rows]  # no step twice
        assert all(r["clients_used"] == 2 for r in rows)
    assert_no_leftovers(resumed.run_dir / "flwr-home")
