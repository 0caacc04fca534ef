"""The model an algorithm sends, as Flower records: full fp32, or the versioned lattice downlink.

FedAvg, FedBuff and EASGD (its center) send one model to many devices. With ``downlink-codec =
"none"`` every device gets the full fp32 model. With ``lattice:...`` each gets the smallest message
that brings its copy to the current version (``fedge.aggregation.broadcast``): the change of one
version, a catch-up from the cache, or a snapshot. This module builds those records, records which
version each device holds once it replies (or forgets it when it fails) and counts the bytes of
each kind for the metrics row.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedge.aggregation.broadcast import DownlinkMessage, VersionedBroadcast, parse_downlink
from fedge.protocol import (
    CONFIG_RECORD,
    DOWNLINK_BASE_ERROR,
    DOWNLINK_BASE_KEY,
    DOWNLINK_RECORD,
    DOWNLINK_STEPS_KEY,
    MODEL_RECORD,
    PAYLOAD_KEY,
    flat_array,
    payload_array,
)
from fedge.tasks import Task, flatten_state, seeded_initial_params, tensor_sizes, unflatten_state

__all__ = ["Downlink"]

log = logging.getLogger(__name__)


class Downlink:
    """One run's downlink. ``template``/``seed``/``init`` say what the lattice's base is."""

    def __init__(self, spec: str, task: Task, template: dict[str, torch.Tensor], seed: int, init: str) -> None:
        self.parsed = parse_downlink(spec)
        self.template = template
        self.broadcast: VersionedBroadcast | None = None
        if self.parsed is not None:  # from a model file, the base is that model (set in start())
            base = flatten_state(template) if init else seeded_initial_params(task, seed)
            self.broadcast = VersionedBroadcast(self.parsed, base, tensor_sizes(template), seeded=not init)
        self._init = init
        self.reset_tally()

    @property
    def spec(self) -> str:
        return "none" if self.parsed is None else self.parsed.spec

    def start(self, params: torch.Tensor) -> None:
        """A run started from a model file: the lattice's base is that model (shipped to devices)."""
        if self.broadcast is not None and self._init:
            self.broadcast = VersionedBroadcast(self.broadcast.spec, params, tensor_sizes(self.template), seeded=False)

    def config_keys(self) -> dict[str, Any]:
        """Keys every message of the current version carries in its config record."""
        if self.broadcast is None:
            return {"downlink-codec": "none"}
        b = self.broadcast
        return {"downlink-codec": self.spec, "downlink-version": b.version, "downlink-digest": b.digest,
                "downlink-base-digest": b.base_digest}

    def publish(self, params: torch.Tensor, version: int) -> None:
        """Make ``params`` the model of ``version`` (once per version; later calls for it do nothing)."""
        if self.broadcast is not None and self.broadcast.version < version:
            self.broadcast.publish(params, version)

    def contents(self, params: torch.Tensor, nodes: list[int], config: ConfigRecord) -> dict[int, RecordDict]:
        """Each node's message content: the model record (full or lattice) and ``config``."""
        if self.broadcast is None:
            model = ArrayRecord(unflatten_state(params, self.template))
            return {n: RecordDict({MODEL_RECORD: model, CONFIG_RECORD: config}) for n in nodes}
        out = {}
        for node in nodes:
            message = self.broadcast.message_for(node)
            self._count(message)
            out[node] = RecordDict({DOWNLINK_RECORD: self._record(message), CONFIG_RECORD: config})
        return out

    @staticmethod
    def _record(message: DownlinkMessage) -> ArrayRecord:
        arrays = {PAYLOAD_KEY: payload_array(message.payload)}
        if message.steps is not None:
            arrays[DOWNLINK_STEPS_KEY] = flat_array(message.steps)
        if message.base is not None:
            arrays[DOWNLINK_BASE_KEY] = flat_array(message.base)
        return ArrayRecord(arrays)

    def _count(self, message: DownlinkMessage) -> None:
        size = len(message.payload) + (0 if message.steps is None else 4 * message.steps.numel()) \
            + (0 if message.base is None else 4 * message.base.numel())
        self.tally[message.kind] += 1
        self.bytes[message.kind] += size
        if message.kind == "catch-up":
            self.catch_up_sizes.append((message.behind or 0, size))

    def replied(self, node: int, version: int) -> None:
        if self.broadcast is not None:
            self.broadcast.confirm(node, version)

    def settle(self, nodes: list[int], failed: set[int], version: int) -> None:
        """End of a synchronous round: every node that did not fail holds ``version``'s copy (a
        failed one was forgotten by :meth:`failed` when it failed)."""
        for node in nodes:
            if node not in failed:
                self.replied(node, version)

    def failed(self, node: int, reason: str = "") -> None:
        if self.broadcast is not None:
            base = DOWNLINK_BASE_ERROR in reason
            if base:
                log.warning("node %d cannot rebuild the downlink's base model; it will be sent in full", node)
            self.broadcast.forget(node, base=base)

    # -- metrics ------------------------------------------------------------------------------
    def reset_tally(self) -> None:
        self.tally: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.catch_up_sizes: list[tuple[int, int]] = []

    def metrics(self) -> dict[str, Any]:
        """What this step sent, by kind (bytes include the steps and base arrays), then reset."""
        if self.broadcast is None:
            self.reset_tally()
            return {}
        sizes = [size for _, size in self.catch_up_sizes]
        out = {
            "downlink_version": self.broadcast.version,
            "downlink_current": self.tally["current"], "downlink_current_bytes": self.bytes["current"],
            "downlink_catch_up": self.tally["catch-up"], "downlink_catch_up_bytes": self.bytes["catch-up"],
            "downlink_snapshot": self.tally["snapshot"], "downlink_snapshot_bytes": self.bytes["snapshot"],
            "downlink_catch_up_sizes": [[behind, size] for behind, size in self.catch_up_sizes],
        }
        if sizes:
            out["downlink_catch_up_median_bytes"] = statistics.median(sizes)
        self.reset_tally()
        return out

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {} if self.broadcast is None else self.broadcast.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.broadcast is not None and state:
            self.broadcast.load_state_dict(state)
