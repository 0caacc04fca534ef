"""Slow devices on purpose, as a Flower mod: benchmarks and tests need stragglers they can trust.

A node slowed by a factor F takes F times as long as its real work: the mod times the handler and
then sleeps (F − 1) times that, so the delay scales with the model, the data and the machine
instead of being a made-up constant. Where the factor comes from:

- node config ``slowdown=F`` (a SuperNode started with ``--node-config "... slowdown=5"``);
- otherwise the run setting ``stragglers = "fraction=0.25,slowdown=5"``: the first
  ⌈fraction × num-partitions⌉ partitions are slowed. This is how a simulation (whose nodes share one
  node config) gets a reproducible set of slow clients.

Only train messages are slowed: evaluation and other traffic keep their real speed.
"""

from __future__ import annotations

import logging
import math
import time

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from protocol.stragglers import parse_stragglers

__all__ = ["slowdown_mod", "slowdown_of"]

log = logging.getLogger(__name__)


def slowdown_of(context: Context) -> float:
    """This node's slowdown factor (1 = real speed)."""
    own = context.node_config.get("slowdown")
    if own is not None:
        factor = float(own)
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"node config slowdown must be >= 1, got {own!r}")
        return factor
    fraction, slowdown = parse_stragglers(str(context.run_config.get("stragglers", "none")))
    if fraction <= 0.0 or slowdown == 1.0:
        return 1.0
    partition = context.node_config.get("partition-id")
    partitions = context.node_config.get("num-partitions")
    if partition is None or partitions is None:
        return 1.0
    return slowdown if int(partition) < math.ceil(fraction * int(partitions)) else 1.0


def slowdown_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    factor = slowdown_of(context)
    if factor == 1.0 or not msg.metadata.message_type.startswith("train"):
        return call_next(msg, context)
    started = time.perf_counter()
    reply = call_next(msg, context)
    extra = (factor - 1.0) * (time.perf_counter() - started)
    log.info("slowdown x%g on purpose: %.2f s more", factor, extra)
    time.sleep(extra)
    return reply
