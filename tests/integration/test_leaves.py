"""Beyond one SuperLink on Flower's own processes: a root SuperLink whose two nodes are bridges,
each to a leaf (a SuperLink of its own, two device SuperNodes, a leaf coordinator's run), all on
127.0.0.1; the root's rounds train the leaves' devices and every process stops at the end."""

from __future__ import annotations

import json

import pytest

from fedge.server.local import launch
from fedge.server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def test_two_leaves_of_two_devices_train_under_one_root(tmp_path, assert_no_leftovers) -> None:
    settings = RunSettings(rounds=2, clients_per_round=2, local_epochs=1, run_dir=str(tmp_path / "run"),
                           wait_for_nodes=120.0)
    result = launch(settings, engine="deployment", num_supernodes=4, leaves=2, timeout=360)
    assert [r["round"] for r in result.rows] == [1, 2]
    assert all(r["clients_used"] == 2 and not r["rejected"] for r in result.rows), result.rows
    assert result.summary is not None and result.summary["final_accuracy"] > result.summary["initial_accuracy"]
    for leaf in ("leaf-0", "leaf-1"):  # each leaf stepped its own two devices once per root round
        rows = [json.loads(line) for line in (tmp_path / "run" / leaf / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2] and all(r["clients_used"] == 2 for r in rows)
