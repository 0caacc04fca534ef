"""The slowdown mod: which nodes it slows, and by how much of their real work."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import types

import pytest
from flwr.app import Context, Message, RecordDict

from fedge.edge_client import slowdown
from fedge.protocol.stragglers import parse_stragglers


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
    monkeypatch.setattr(slowdown, "_handled_in_process", False)
    monkeypatch.delitem(sys.modules, slowdown._CLIENTAPP_PROCESS_MODULE, raising=False)  # not a deployment process
    msg = Message(RecordDict(), dst_node_id=1, message_type="train")
    reply = slowdown.slowdown_mod(msg, _context(0, slowdown=5), lambda m, c: m)
    assert reply is msg and slept == [pytest.approx(10.0)]  # (5 - 1) x 2.5 s
    evaluate = Message(RecordDict(), dst_node_id=1, message_type="evaluate")
    slowdown.slowdown_mod(evaluate, _context(0, slowdown=5), lambda m, c: m)
    assert len(slept) == 1  # evaluation keeps its real speed


def test_a_deployment_clientapp_process_counts_its_start_as_the_first_messages_work(monkeypatch) -> None:
    """In Flower's one-message ``flwr-clientapp`` process, starting the process is the device's work
    for that message too: a slow device sleeps (F - 1) x the process's age at the handler's end.
    Later messages in the same process (and every message in a simulation worker) count the handler."""
    ticks = iter([10.0, 12.5, 20.0, 22.5])  # each handler "takes" 2.5 s
    slept: list[float] = []
    monkeypatch.setattr(slowdown.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(slowdown.time, "sleep", slept.append)
    monkeypatch.setattr(slowdown, "process_age", lambda: 30.0)  # started 30 s before the handler ended
    monkeypatch.setattr(slowdown, "_handled_in_process", False)
    monkeypatch.setitem(sys.modules, slowdown._CLIENTAPP_PROCESS_MODULE, types.ModuleType("run_clientapp"))
    msg = Message(RecordDict(), dst_node_id=1, message_type="train")
    slowdown.slowdown_mod(msg, _context(0, slowdown=5), lambda m, c: m)
    slowdown.slowdown_mod(msg, _context(0, slowdown=5), lambda m, c: m)
    assert slept == [pytest.approx(120.0), pytest.approx(10.0)]  # 4 x 30 s, then 4 x 2.5 s


def test_the_deployment_process_marker_exists_in_this_flower() -> None:
    """The mod recognises Flower's one-message ClientApp process by this module: if a Flower
    upgrade moves it, slow devices would silently fall back to handler timing."""
    assert importlib.util.find_spec(slowdown._CLIENTAPP_PROCESS_MODULE) is not None


def test_process_age_of_a_fresh_process_is_its_age() -> None:
    if slowdown.process_age() is None:
        pytest.skip("no /proc on this platform: the handler's time is used")
    began = time.monotonic()
    probe = "from fedge.edge_client.slowdown import process_age; print(process_age())"
    done = subprocess.run([sys.executable, "-c", probe],
                          capture_output=True, text=True, timeout=120, check=True)
    elapsed = time.monotonic() - began
    age = float(done.stdout.strip())
    # its start to its question: inside the parent's measured span (10 ms clock ticks)
    assert 0.0 < age <= elapsed + 0.02


def test_process_age_is_none_without_proc(monkeypatch) -> None:
    def unreadable(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr("builtins.open", unreadable)
    assert slowdown.process_age() is None
