"""The slowdown mod: which nodes it slows, and by how much of their real work."""

from __future__ import annotations

import pytest
from flwr.app import Context, Message, RecordDict

from edge_client import slowdown
from protocol.stragglers import parse_stragglers


def _context(partition: int, partitions: int = 8, stragglers: str = "none", **node) -> Context:
    return Context(run_id=1, node_id=partition + 1, state=RecordDict(), run_config={"stragglers": stragglers},
                   node_config={"partition-id": partition, "num-partitions": partitions, **node})


def test_stragglers_setting_slows_the_first_partitions() -> None:
    factors = [slowdown.slowdown_of(_context(p, stragglers="fraction=0.25,slowdown=5")) for p in range(8)]
    assert factors == [5.0, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert slowdown.slowdown_of(_context(0)) == 1.0
    assert slowdown.slowdown_of(_context(7, slowdown=3)) == 3.0  # node config wins


@pytest.mark.parametrize("spec", ["fraction=2", "slowdown=0.5", "speed=3", "fraction=x"])
def test_bad_stragglers_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_stragglers(spec)


def test_mod_sleeps_in_proportion_to_the_real_work(monkeypatch) -> None:
    ticks = iter([10.0, 12.5])  # the handler "takes" 2.5 s
    slept: list[float] = []
    monkeypatch.setattr(slowdown.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(slowdown.time, "sleep", slept.append)
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    msg = Message(RecordDict(), dst_node_id=1, message_type="train")
    reply = slowdown.slowdown_mod(msg, _context(0, slowdown=5), lambda m, c: m)
    assert reply is msg and slept == [pytest.approx(10.0)]  # (5 - 1) x 2.5 s
    evaluate = Message(RecordDict(), dst_node_id=1, message_type="evaluate")
    slowdown.slowdown_mod(evaluate, _context(0, slowdown=5), lambda m, c: m)
    assert len(slept) == 1  # evaluation keeps its real speed
