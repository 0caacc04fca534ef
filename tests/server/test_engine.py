"""The round engine on an in-process stand-in for Flower's Grid (the real ClientApp handlers)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import MetricRecord, RecordDict

from fedge.compression import make_codec
from fedge.protocol import METRICS_RECORD, UPDATE_RECORD, payload_record
from fedge.server.algorithms.registry import make_algorithm
from fedge.server.run.checkpoint import CheckpointStore, IncompatibleCheckpointError
from fedge.server.engine.loop import Engine, make_context, sample_nodes
from fedge.server.run.initial_model import initial_params
from fedge.server.run.run_directory import RunDirectory
from fedge.server.settings import RunSettings
from fedge.tasks import make_task
from tests.server.in_process_grid import FakeClock, InProcessGrid

TASK = make_task("digits")


def _engine(tmp_path, clock: FakeClock | None = None, **overrides) -> Engine:
    values = dict(rounds=2, clients_per_round=3, local_epochs=1, round_timeout=5.0, wait_for_nodes=1.0,
                  run_dir=str(tmp_path / "run"))
    values.update(overrides)
    settings = RunSettings(**values)
    run_dir = RunDirectory(settings.run_dir)
    run_dir.start(settings)
    algorithm = make_algorithm(settings.algorithm, make_context(settings, TASK))
    clock = clock or FakeClock()
    return Engine(algorithm, run_dir, clock=clock, sleep=clock.sleep)


def _start(engine: Engine) -> torch.Tensor:
    return initial_params(TASK, engine.settings.seed)


def test_sampling_depends_on_seed_and_step_only() -> None:
    nodes = list(range(100, 140))
    first = sample_nodes(nodes, 10, seed=42, step=3)
    # Flower numbers nodes at random in every run; the sample takes positions in the canonical
    # order the engine gives it (the roster's: by partition), so other numbers pick the same partitions
    renumbered = [9_000 - 7 * n for n in nodes]
    again = sample_nodes(renumbered, 10, seed=42, step=3)
    assert [renumbered.index(n) for n in again] == [nodes.index(n) for n in first]
    assert [nodes.index(n) for n in first] == sorted(nodes.index(n) for n in first)  # in the given order
    assert first != sample_nodes(nodes, 10, seed=42, step=4)
    assert first != sample_nodes(nodes, 10, seed=43, step=3)
    assert len(set(first)) == 10 and set(first) <= set(nodes)
    big = [2**63 + i for i in range(5)]  # unsigned 64-bit node ids survive (never through float64)
    assert set(sample_nodes(big, 3, 1, 1)) <= set(big)


def test_fedavg_round_trains_and_accounts_bytes(tmp_path) -> None:
    engine = _engine(tmp_path)
    grid = InProcessGrid(3)
    start = _start(engine)
    before = engine.evaluate(start)["accuracy"]
    result = engine.run(grid, start)
    assert [r.round for r in result.rows] == [1, 2]
    row = result.rows[-1]
    assert row.clients_used == 3 and row.clients_failed == 0 and not row.rejected
    assert row.accuracy > before
    wire = make_codec(engine.settings.codec).wire_bytes(engine.ctx.numel)
    assert row.uplink_bytes == 3 * wire  # the real payloads, headers included
    assert row.downlink_bytes == 3 * engine.ctx.fp32_bytes
    assert row.uplink_fp32_bytes == 3 * engine.ctx.fp32_bytes
    assert [m.metadata.message_type for m in grid.pushed] == ["train"] * 6


def test_client_evaluation_and_compressed_downlink(tmp_path) -> None:
    """Central and federated evaluation (``evaluate=both``, the devices every 2 rounds) and the
    lattice downlink: snapshots first, each version's change afterwards (also on a real engine in
    the slow ``tests/integration/test_resume.py``)."""
    engine = _engine(tmp_path, rounds=4, evaluate="both", evaluate_every=2, downlink_codec="lattice:ratio=0.05")
    grid = InProcessGrid(3)
    rows = engine.run(grid, _start(engine)).rows
    assert [r.extra.get("federated_replies") for r in rows] == [None, 3, None, 3]
    assert all(0.0 < rows[i].extra["federated_accuracy"] <= 1.0 for i in (1, 3))
    assert all(r.evaluation == "central" and 0.0 < r.accuracy <= 1.0 for r in rows)
    assert "evaluate" in [m.metadata.message_type for m in grid.pushed]
    full = 3 * engine.ctx.fp32_bytes
    assert rows[0].extra["downlink_snapshot"] == 3 and rows[0].downlink_bytes < full / 8
    assert [r.extra["downlink_current"] for r in rows[1:]] == [3, 3, 3]
    train_bytes = [r.extra["downlink_current_bytes"] for r in rows[1:]]
    assert 0 < max(train_bytes) < full / 20


def test_round_timeout_and_min_replies(tmp_path) -> None:
    clock = FakeClock()
    engine = _engine(tmp_path, clock, rounds=1, min_replies=2, round_timeout=7.0)
    grid = InProcessGrid(3, silent={1, 2})
    start = _start(engine)
    result = engine.run(grid, start)
    (row,) = result.rows
    assert row.clients_used == 1 and row.clients_failed == 2
    assert sorted(r["reason"] for r in row.rejected) == ["no reply within 7 s"] * 2
    assert clock.now >= 7.0  # the deadline passed on the simulated clock, no real waiting
    assert torch.equal(result.model, start)  # 1 valid reply < min-replies 2: model unchanged


def test_updates_beyond_the_exact_sums_range_are_refused_and_keep_the_model(tmp_path) -> None:
    codec = make_codec("none")

    def huge(msg, context):  # finite float32 values, beyond what the coordinator's exact sum holds
        from flwr.app import Message

        payload = codec.encode(torch.full((38_282,), 3.0e38))
        return Message(RecordDict({UPDATE_RECORD: payload_record(payload),
                                   METRICS_RECORD: MetricRecord({"num-examples": 1})}), reply_to=msg)

    engine = _engine(tmp_path, rounds=1, codec="none")
    start = _start(engine)
    result = engine.run(InProcessGrid(3, app=huge), start)
    (row,) = result.rows
    assert row.clients_used == 0 and row.clients_failed == 3
    assert all(r["kind"] == "invalid" and "beyond the exact sum's range" in r["reason"] for r in row.rejected)
    assert torch.equal(result.model, start)


def test_resume_continues_from_the_checkpoint(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=2)
    first = engine.run(InProcessGrid(3), _start(engine))
    saved = CheckpointStore(tmp_path / "run" / "checkpoint").load()
    assert saved.round == 2 and saved.algorithm == "fedavg" and torch.equal(saved.state["params"], first.model)
    more = _engine(tmp_path, rounds=3)
    result = more.run(InProcessGrid(3), _start(more))
    assert result.resumed_from == 2 and [r.round for r in result.rows] == [1, 2, 3]
    assert [r["round"] for r in more.run_dir.metrics.read()] == [1, 2, 3]
    done = _engine(tmp_path, rounds=3)
    grid = InProcessGrid(3)
    assert done.run(grid, _start(done)).resumed_from == 3 and not grid.pushed  # nothing left to do


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff:concurrency=3,buffer=2", "easgd", "gossip:topology=ring"])
def test_a_stop_request_ends_the_run_at_a_step_boundary_and_resume_finishes_it(tmp_path, algorithm) -> None:
    """The resumed run gets a fresh grid: node state (EASGD and gossip local models, error feedback) is
    lost, as on a restarted simulation, and the algorithm state comes from the checkpoint alone."""
    engine = _engine(tmp_path, rounds=3, algorithm=algorithm)
    engine.on_row = lambda row: engine.run_dir.request_stop() if row.round == 1 else None
    stopped = engine.run(InProcessGrid(3), _start(engine))
    assert stopped.stopped and [r.round for r in stopped.rows] == [1]
    assert CheckpointStore(tmp_path / "run" / "checkpoint").load().round == 1
    engine.run_dir.clear_stop()
    again = _engine(tmp_path, rounds=3, algorithm=algorithm)
    result = again.run(InProcessGrid(3), _start(again))
    assert not result.stopped and result.resumed_from == 1 and [r.round for r in result.rows] == [1, 2, 3]


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff:concurrency=3,buffer=2"])
def test_stop_accuracy_ends_the_run_complete_and_a_restart_trains_no_further(tmp_path, algorithm) -> None:
    """The run ends at the first step whose held-out accuracy reaches stop-accuracy, as complete (not
    paused); restarting it pushes nothing."""
    full = _engine(tmp_path / "full", rounds=6, algorithm=algorithm)
    reference = [row.accuracy for row in full.run(InProcessGrid(3), _start(full)).rows]
    # a target the run reaches after its first step and before its last: stops exactly there
    target = max(reference[1:-1])
    first_hit = next(i for i, a in enumerate(reference) if a >= target) + 1
    assert 1 < first_hit < 6
    engine = _engine(tmp_path / "stop", rounds=6, algorithm=algorithm, stop_accuracy=target)
    result = engine.run(InProcessGrid(3), _start(engine))
    assert result.reached_target and not result.stopped
    assert [r.round for r in result.rows] == list(range(1, first_hit + 1))
    assert result.rows[-1].accuracy >= target > max(r.accuracy for r in result.rows[:-1])
    assert CheckpointStore(tmp_path / "stop" / "run" / "checkpoint").load().round == first_hit
    again = _engine(tmp_path / "stop", rounds=6, algorithm=algorithm, stop_accuracy=target)
    grid = InProcessGrid(3)
    resumed = again.run(grid, _start(again))
    assert resumed.resumed_from == first_hit and not grid.pushed and torch.equal(resumed.model, result.model)


def test_old_or_foreign_checkpoints_are_refused(tmp_path) -> None:
    engine = _engine(tmp_path, rounds=1)
    engine.run(InProcessGrid(3), _start(engine))
    other = _engine(tmp_path / "x", rounds=1, algorithm="easgd")
    other.run_dir = engine.run_dir
    with pytest.raises(IncompatibleCheckpointError, match="written by algorithm 'fedavg'"):
        other.run(InProcessGrid(3), _start(other))
    store = CheckpointStore(tmp_path / "run" / "checkpoint")
    torch.save({"format": "fedge.checkpoint/1", "round": 1, "params": torch.zeros(3)}, store.current)
    with pytest.raises(IncompatibleCheckpointError, match="before the round engine"):
        store.load()
    assert store.current.exists()  # refused, not quarantined: the user decides


def test_fault_mod_covers_every_handler(tmp_path) -> None:
    for algorithm in ("fedavg", "easgd", "gossip"):
        engine = _engine(tmp_path / algorithm, rounds=1, algorithm=algorithm)
        grid = InProcessGrid(3, node_config={1: {"fault": "bitflip"}})
        (row,) = engine.run(grid, _start(engine)).rows
        assert row.clients_used == 2, algorithm
        (rejected,) = row.rejected
        assert rejected["node"] == grid.node_id(1) and rejected["reason"].startswith("checksum mismatch")


def test_a_refused_upload_is_in_the_uplink_bytes_and_in_their_fp32_baseline(tmp_path) -> None:
    """``uplink_bytes`` counts every upload that arrived, used or refused, so its fp32 baseline counts
    the same uploads (until 2026-12-03 it counted the used ones only, and a round with a refused
    reply understated the compression ratio)."""
    engine = _engine(tmp_path, rounds=1)
    (row,) = engine.run(InProcessGrid(3, node_config={1: {"fault": "bitflip"}}), _start(engine)).rows
    assert row.clients_used == 2 and len(row.rejected) == 1
    assert row.uplink_bytes == 3 * make_codec(engine.settings.codec).wire_bytes(engine.ctx.numel)
    assert row.uplink_fp32_bytes == 3 * engine.ctx.fp32_bytes


def test_client_rejects_a_malformed_downlink(tmp_path) -> None:
    """The client validates the model it receives as strictly as the server validates an update."""
    from flwr.app import Array

    from fedge.coordinator.dispatcher import step_messages
    from fedge.coordinator.tally import Tally

    engine = _engine(tmp_path, rounds=1)
    grid = InProcessGrid(3)
    engine.algorithm.start(_start(engine))
    driver = engine._open(1, grid.get_node_ids(), 3, engine._exchange(grid, 1), Tally(0.0))
    outgoing = engine._send(driver, grid.get_node_ids())
    content = outgoing[0].content
    record = content.array_records["arrays"]
    first = next(iter(record.keys()))
    record[first] = Array(torch.full(tuple(record[first].shape), float("nan")).numpy())
    messages = step_messages(outgoing[:1], 1, "train")
    grid.push_messages(messages)
    (reply,) = grid.pull_messages([messages[0].metadata.message_id])
    assert reply.has_error() and "NaN" in reply.error.reason
    del content.array_records["arrays"][first]
    messages = step_messages(outgoing[:1], 1, "train")
    grid.push_messages(messages)
    (reply,) = grid.pull_messages([messages[0].metadata.message_id])
    assert reply.has_error() and "does not match the model" in reply.error.reason


def test_model_average_is_what_the_run_measures_and_delivers_and_it_resumes(tmp_path) -> None:
    """With ``model-average = ema``, each row measures the average of the published models, the
    result is that average (the algorithm's own model keeps training), and a resumed run continues
    the average from the checkpoint exactly as an uninterrupted one (fp32 updates: a new grid's
    devices hold no error-feedback memory, so only fp32 training is the same after a restart)."""
    whole = _engine(tmp_path / "whole", rounds=3, codec="none", model_average="ema:decay=0.5")
    result = whole.run(InProcessGrid(3), _start(whole))
    trained = whole.algorithm.final_model()
    assert not torch.equal(result.model, trained)
    assert result.rows[-1].extra["model_average"] == "ema:decay=0.5"
    assert result.rows[-1].accuracy == pytest.approx(whole.evaluate(result.model)["accuracy"])
    part = _engine(tmp_path / "part", rounds=2, codec="none", model_average="ema:decay=0.5")
    part.run(InProcessGrid(3), _start(part))
    rest = _engine(tmp_path / "part", rounds=3, codec="none", model_average="ema:decay=0.5")
    resumed = rest.run(InProcessGrid(3), _start(rest))
    assert resumed.resumed_from == 2 and torch.allclose(resumed.model, result.model, atol=1e-6)
    with pytest.raises(ValueError, match="model-average"):  # a run directory keeps its average
        _engine(tmp_path / "part", rounds=4, codec="none")


def test_model_average_is_refused_where_there_is_no_global_model(tmp_path) -> None:
    with pytest.raises(ValueError, match="model-average"):
        _engine(tmp_path, algorithm="gossip:topology=ring", model_average="ema")


def test_a_step_closes_without_being_published(tmp_path) -> None:
    """``run_step`` closes a step (what a leaf coordinator would forward: the released partial of
    its devices' updates) and writes nothing; ``publish`` then writes its row and checkpoint."""
    engine = _engine(tmp_path, rounds=1, clients_per_round=3)
    grid = InProcessGrid(3)
    engine._restore(_start(engine))
    closed = engine.run_step(grid, 1)
    released = closed.step.released
    assert released is not None and released.count == closed.tally.used == 3
    assert sorted(released.members) == sorted(grid.get_node_ids()) and not released.noised
    assert engine.run_dir.metrics.read() == [] and engine.run_dir.checkpoints.load() is None
    torch.testing.assert_close(closed.outcome.model, _start(engine) + released.mean())  # FedAvg's plain step
    row = engine.publish(grid, closed, None)
    assert row.clients_used == 3 and engine.run_dir.checkpoints.load().round == 1
