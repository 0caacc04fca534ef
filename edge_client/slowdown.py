"""Slow devices on purpose, as a Flower mod: benchmarks and tests need stragglers they can trust.

A node slowed by a factor F takes F times as long as its real work: the mod times that work and
then sleeps (F − 1) times it, so the delay scales with the model, the data and the machine
instead of being a made-up constant. What counts as the work of a message depends on the engine:

- simulation (Ray): a long-lived worker runs many messages, so the work is the handler's time;
- deployment: each message runs in a process of its own (a child forked from the device's warm
  process, or with Flower's default a fresh ``flwr-clientapp`` that imports Python, Flower and
  torch first), and starting it is work the device does for that message. A slow device is slow
  at that too, so in such a process the first train message's work runs from the process's start
  (``/proc/self/stat``) to the handler's end. Timing the handler alone made a ``slowdown=5``
  SuperNode only ~1.6 times slower per message than its peers (16 SuperNodes on 2 cores), not 5.

The work is wall-clock time, as the device sees it: on a host shared by many emulated devices it
includes waiting for a CPU, which keeps a slow device F times slower than a fast one under the
same contention (a CPU-time measure would make it barely slower when the CPUs are oversubscribed).

Where the factor comes from:

- node config ``slowdown=F`` (a SuperNode started with ``--node-config "... slowdown=5"``);
- otherwise the run setting ``stragglers = "fraction=0.25,slowdown=5"``: the first
  ⌈fraction × num-partitions⌉ partitions are slowed. This is how a simulation (whose nodes share one
  node config) gets a reproducible set of slow clients.

``jitter=J`` (in the same setting, or a node's own config) adds a random delay of up to ``J``
seconds to every train reply, drawn from the operating system: the replies' order then differs from
run to run, which the reproducibility tests use to show that it changes nothing.

Only train messages are slowed: evaluation and other traffic keep their real speed.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import sys
import time

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.protocol.secagg import secure_stage
from fedge.protocol.stragglers import parse_stragglers

__all__ = ["jitter_of", "process_age", "slowdown_mod", "slowdown_of"]

log = logging.getLogger(__name__)

#: imported by Flower's ``flwr-clientapp`` command, the deployment engine's one-message process (and
#: by the SuperNode's CLI package, which never runs a ClientApp in its own process); never by the
#: simulation engine. A test checks that it exists in the installed Flower.
_CLIENTAPP_PROCESS_MODULE = "flwr.supernode.runtime.run_clientapp"
_handled_in_process = False


def slowdown_of(context: Context) -> float:
    """This node's slowdown factor (1 = real speed)."""
    own = context.node_config.get("slowdown")
    if own is not None:
        factor = float(own)
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"node config slowdown must be >= 1, got {own!r}")
        return factor
    spec = parse_stragglers(str(context.run_config.get("stragglers", "none")))
    fraction, slowdown = spec.fraction, spec.slowdown
    if fraction <= 0.0 or slowdown == 1.0:
        return 1.0
    partition = context.node_config.get("partition-id")
    partitions = context.node_config.get("num-partitions")
    if partition is None or partitions is None:
        return 1.0
    return slowdown if int(partition) < math.ceil(fraction * int(partitions)) else 1.0


def process_age() -> float | None:
    """Seconds since this process started (Linux ``/proc``), or None where that is unknown."""
    try:
        with open("/proc/self/stat", "rb") as stat:  # bytes: the command name may be anything
            # after the ')' closing the command name, index 0 is field 3 (state): starttime is 22
            start_ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as uptime:
            now = float(uptime.read().split()[0])
        return max(0.0, now - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _work_seconds(handler_seconds: float) -> tuple[float, str]:
    """The message's work and what it covers: the handler's time, or in a deployment ClientApp
    process's first train message, everything since the process started (module docstring)."""
    global _handled_in_process
    first, _handled_in_process = not _handled_in_process, True
    if first and _CLIENTAPP_PROCESS_MODULE in sys.modules:
        age = process_age()
        if age is not None:
            return max(age, handler_seconds), "since the process started"
    return handler_seconds, "in the handler"


def jitter_of(context: Context) -> float:
    """The most seconds a train reply of this node is held back at random (the ``stragglers``
    setting's ``jitter``; node config ``jitter=J`` for one node)."""
    own = context.node_config.get("jitter")
    if own is not None:
        return parse_stragglers(f"jitter={own}").jitter
    return parse_stragglers(str(context.run_config.get("stragglers", "none"))).jitter


def slowdown_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    factor, jitter = slowdown_of(context), jitter_of(context)
    if (factor == 1.0 and jitter == 0.0) or not msg.metadata.message_type.startswith("train") or secure_stage(msg):
        return call_next(msg, context)
    started = time.perf_counter()
    reply = call_next(msg, context)
    work, span = _work_seconds(time.perf_counter() - started)
    extra = (factor - 1.0) * work
    if jitter:  # the OS's randomness, never the run's seed: the order of replies changes every run
        extra += jitter * secrets.randbelow(1 << 20) / (1 << 20)
    log.info("slowdown x%g, jitter up to %g s, on purpose: %.2f s of work %s, %.2f s more", factor, jitter, work,
             span, extra)
    time.sleep(extra)
    return reply
