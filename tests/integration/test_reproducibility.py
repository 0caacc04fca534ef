"""Same seed, same run, on both of Flower's engines: replies delayed at random change nothing.

Each test runs one seed twice, the second time with every train reply held back a random 0..J s
(the ``stragglers`` setting's ``jitter``, drawn from the OS, so the replies reach the coordinator in
another order), and compares ``metrics.jsonl`` row by row, wall-time fields aside, and the final
model's digest. The setting is the one whose runs parted most before aggregation was exact and
nodes were named by partition: partial participation, DGC with error feedback and 4-bit QSGD, a
lattice downlink, the sparse mean and a model average.
"""

from __future__ import annotations

import re

import pytest

from fedge.server.local import launch
from fedge.server.run.metrics_row import without_timing
from fedge.server.settings import RunSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

_SETTING = dict(codec="dgc:ratio=0.05,sample=0.2,warmup=0+qsgd:bits=4", downlink_codec="lattice:ratio=0.05",
                aggregator="sparse-mean", model_average="ema:decay=0.8", local_epochs=1, round_timeout=120,
                wait_for_nodes=120)


def _rows(result) -> list[dict]:  # type: ignore[no-untyped-def]
    return [without_timing(row) for row in result.rows]


def _arrivals(result) -> list[str]:  # type: ignore[no-untyped-def]
    """The partitions whose replies the coordinator used, each round in the order they arrived."""
    log = (result.run_dir / "logs" / "flwr-run.log").read_text()
    return re.findall(r"round \d+: used replies arrived from partitions (\[.*?\])", log)


def test_simulation_same_seed_same_bits_whatever_the_reply_order(tmp_path, assert_no_leftovers) -> None:
    """Ten simulated clients, four a round (the roll call names them by partition, so the same
    partitions are drawn though Flower numbers the nodes anew each run); a second seed differs. The
    plain run has one Ray slot, as each of a benchmark's parallel seeds does (``bench/harness/seeds.py``),
    and the jittered one a slot per client of a round: the slots a run gets change nothing either."""
    runs = {}
    for name, seed, stragglers, slots, rounds in (("plain", 42, "none", 1, 3), ("jittered", 42, "jitter=0.4", 4, 3),
                                                  ("other-seed", 7, "none", 4, 1)):  # one round shows it differs
        settings = RunSettings(rounds=rounds, clients_per_round=4, seed=seed, stragglers=stragglers,
                               run_dir=str(tmp_path / name), **_SETTING)
        # a slot per client of a round: a delayed client holds its own slot, the others overtake it
        runs[name] = launch(settings, engine="simulation", num_supernodes=10, parallel_clients=slots, timeout=300)
        assert_no_leftovers(runs[name].run_dir / "flwr-home")
    plain, jittered, other = runs["plain"], runs["jittered"], runs["other-seed"]
    assert [row["clients_used"] for row in plain.rows] == [4, 4, 4]
    assert len(_arrivals(plain)) == 3 and _arrivals(jittered) != _arrivals(plain)  # the order did change
    assert _rows(jittered) == _rows(plain)
    assert jittered.summary["model_digest"] == plain.summary["model_digest"]
    assert plain.rows[-1]["model_digest"] != plain.rows[0]["model_digest"]  # the model moved
    assert other.rows[0]["model_digest"] != plain.rows[0]["model_digest"]
    assert other.rows[0]["uplink_bytes"] != plain.rows[0]["uplink_bytes"]


def test_deployment_engine_same_seed_same_bits_whatever_the_reply_order(tmp_path, assert_no_leftovers) -> None:
    """A real SuperLink and three SuperNodes, two sampled a round, every device delayed at random in
    the second run: the same rows and the same model."""
    runs = {}
    for name, stragglers in (("plain", "none"), ("jittered", "jitter=0.6")):
        settings = RunSettings(rounds=2, clients_per_round=2, seed=42, stragglers=stragglers,
                               run_dir=str(tmp_path / name), **_SETTING)
        runs[name] = launch(settings, engine="deployment", num_supernodes=3, timeout=300)
        assert_no_leftovers(runs[name].run_dir / "flwr-home")
    plain, jittered = runs["plain"], runs["jittered"]
    assert [row["clients_used"] for row in plain.rows] == [2, 2]
    assert "jitter up to 0.6 s" in (jittered.run_dir / "logs" / "warm-executor.log").read_text()
    assert _rows(jittered) == _rows(plain)
    assert jittered.summary["model_digest"] == plain.summary["model_digest"]
