"""What each message costs this device, measured and sent with the reply, as a Flower mod.

``resource_mod`` wraps every handler: it reads the process's CPU (``getrusage``: user + system, every
thread) and clock when the message arrives and when the reply is built, and the handlers mark their
phases (:func:`timed` on local training and on encoding/masking), so the report
(:class:`fedge.protocol.resources.ResourceReport`) shows training, encoding and overhead apart.
``startup`` is what the process spent before this message reached the ClientApp: since it started
(a fresh ``flwr-clientapp`` process: interpreter, imports, app install; a warm child: its fork) or,
in a process that runs many messages (the simulation engine's workers), since its previous message.

With node config ``state-dir`` (``fedge-edge join``), each message also appends a line to the
device's own ledger, ``<state-dir>/resources.jsonl``, which ``fedge-edge status`` sums per day.
``resource-report=false`` in the node config leaves the report out of replies (it is a timing side
channel, like ``train-seconds``); the ledger is still kept.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.protocol.refusals import REFUSAL_RECORD
from fedge.protocol.resources import RESOURCES_RECORD, ResourceReport
from fedge.protocol.secagg import secure_stage

__all__ = ["LEDGER", "day_totals", "message_bytes", "resource_mod", "timed"]

log = logging.getLogger(__name__)

LEDGER = "resources.jsonl"
_F = TypeVar("_F", bound=Callable[..., Any])
_phases: ContextVar[dict[str, float] | None] = ContextVar("fedge_resource_phases", default=None)
#: (pid, process CPU, clock) when this process's previous message ended; empty before the first
#: one. The pid tells a forked child (whose CPU counters start again at zero) from its parent.
_previous: list[tuple[int, float, float]] = []


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _process_start() -> float:
    """This process's start (its fork) on the ``time.time`` clock, from /proc; now where there is none."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the CPU spent inside towards ``name`` of the message being handled (if any)."""
    phases = _phases.get()
    if phases is None:
        yield
        return
    started = _cpu()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + _cpu() - started


def timed(name: str) -> Callable[[_F], _F]:
    """Decorator form of :func:`phase`: ``@timed("train")``."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def message_bytes(msg: Message) -> int:
    """The bytes of ``msg`` as Flower serializes it for transfer: every object of its tree."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())


@dataclass
class _Meter:
    cpu: float
    clock: float
    startup_cpu: float
    since: float
    bytes_down: int
    phases: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, msg: Message) -> _Meter:
        cpu, now = _cpu(), time.time()
        if _previous and _previous[-1][0] == os.getpid():
            _, last_cpu, last_clock = _previous[-1]
            startup, since = max(0.0, cpu - last_cpu), last_clock
        else:
            startup, since = cpu, _process_start()
        return cls(cpu=cpu, clock=now, startup_cpu=startup, since=since, bytes_down=message_bytes(msg))

    def report(self) -> ResourceReport:
        spent = _cpu() - self.cpu
        train, encode = self.phases.get("train", 0.0), self.phases.get("encode", 0.0)
        return ResourceReport(
            cpu_seconds=spent + self.startup_cpu, train_cpu_seconds=train, encode_cpu_seconds=encode,
            overhead_cpu_seconds=max(0.0, spent + self.startup_cpu - train - encode),
            startup_cpu_seconds=self.startup_cpu, wall_seconds=max(0.0, time.time() - self.since),
            peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            bytes_down=float(self.bytes_down), bytes_up=0.0)


def _wants_report(context: Context) -> bool:
    value = context.node_config.get("resource-report", True)
    return str(value).strip().lower() not in ("false", "0", "no", "off")


def resource_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    meter = _Meter.start(msg)
    token = _phases.set(meter.phases)
    try:
        reply = call_next(msg, context)
    finally:
        _phases.reset(token)
    report = meter.report()
    if not reply.has_error():
        if _wants_report(context):
            # the report's fields are fixed-size doubles: the reply's size with it in place is
            # final whatever bytes-up then says
            reply.content[RESOURCES_RECORD] = report.record()
            report = report.with_bytes_up(message_bytes(reply))
            reply.content[RESOURCES_RECORD] = report.record()
        else:
            report = report.with_bytes_up(message_bytes(reply))
    _previous[:] = [(os.getpid(), _cpu(), time.time())]
    _append_ledger(context, msg, report, reply)
    return reply


def _append_ledger(context: Context, msg: Message, report: ResourceReport, reply: Message) -> None:
    state_dir = context.node_config.get("state-dir")
    if not state_dir:
        return
    stage = secure_stage(msg)  # a secure round's own exchange: a message, not a round
    entry = {"time": time.time(), "run": msg.metadata.run_id, "type": msg.metadata.message_type,
             **({"stage": stage} if stage else {}),
             "outcome": "error" if reply.has_error() else ("refused" if REFUSAL_RECORD in reply.content.config_records
                                                           else "done"),
             "cpu": report.cpu_seconds, "wall": report.wall_seconds, "bytes_down": report.bytes_down,
             "bytes_up": report.bytes_up, "peak_rss_mib": report.peak_rss_mib}
    try:
        with open(Path(str(state_dir)) / LEDGER, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")
    except OSError as err:  # the ledger is a record for the owner; a full disk must not fail the round
        log.warning("could not append to the resource ledger in %s: %s", state_dir, err)


def day_totals(state_dir: Path, day: datetime.date | None = None) -> dict[str, Any]:
    """What this device spent on ``day`` (local time; default today), from its ledger: messages,
    rounds trained (``train*`` messages that were answered), refusals, errors, CPU-seconds and
    megabytes each way. A line that does not parse is skipped (the ledger is append-only text)."""
    day = day or datetime.date.today()
    totals: dict[str, Any] = {"day": day.isoformat(), "messages": 0, "rounds": 0, "refused": 0, "errors": 0,
                              "cpu_seconds": 0.0, "mb_down": 0.0, "mb_up": 0.0}
    path = Path(state_dir) / LEDGER
    if not path.exists():
        return totals
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
            when = datetime.date.fromtimestamp(float(entry["time"]))
        except (ValueError, KeyError, TypeError):
            continue
        if when != day:
            continue
        totals["messages"] += 1
        outcome = entry.get("outcome")
        totals["rounds"] += int(outcome == "done" and str(entry.get("type", "")).startswith("train")
                                and not entry.get("stage"))
        totals["refused"] += int(outcome == "refused")
        totals["errors"] += int(outcome == "error")
        totals["cpu_seconds"] += float(entry.get("cpu", 0.0))
        totals["mb_down"] += float(entry.get("bytes_down", 0.0)) / 1e6
        totals["mb_up"] += float(entry.get("bytes_up", 0.0)) / 1e6
    return totals
