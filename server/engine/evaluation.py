"""Where a step's model is measured: on the coordinator's held-out data, on the devices, or both.

``evaluate = central | federated | both | auto`` (``auto``: central when the task or the operator
gives the coordinator held-out data, federated otherwise).

* **Central**: the task's ``test_data()``, or the operator's own file (``eval-data = held-out.npz``),
  evaluated in the ServerApp process.
* **Federated**: the step's model (FedAvg's global model, EASGD's center, gossip's average) goes to
  the step's devices (an asynchronous run: a seeded sample of ``clients-per-round`` connected
  devices) in ``evaluate`` messages. Each evaluates it on its local held-out split (``holdout``
  of its data, set aside from training for the whole run) and replies with its example count and
  metrics. The combined figure of each metric is the example-weighted mean of the devices' figures,
  i.e. the figure on the union of their held-out splits.

A device's reply is checked like an update: a positive integer example count, the metric names the
task reports, finite values; an implausible reply is logged and left out of the mean, never trusted.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, MessageType, RecordDict

from fedge.aggregation.exact_sum import ExactScalar
from fedge.protocol import CONFIG_RECORD, METRICS_RECORD, MODEL_RECORD
from fedge.protocol.failures import Failure
from fedge.server.engine.algorithm import Outgoing, Rejected, RunContext
from fedge.tasks import unflatten_state

__all__ = ["EVALUATION_MODES", "FederatedEvaluation", "evaluation_mode"]

log = logging.getLogger(__name__)

EVALUATION_MODES = ("auto", "central", "federated", "both")


def evaluation_mode(setting: str, has_central_data: bool) -> str:
    """The resolved mode (``central``, ``federated`` or ``both``) of an ``evaluate`` setting."""
    if setting not in EVALUATION_MODES:
        raise ValueError(f"evaluate must be one of {', '.join(EVALUATION_MODES)}, got {setting!r}")
    if setting == "auto":
        return "central" if has_central_data else "federated"
    if setting in ("central", "both") and not has_central_data:
        raise ValueError(f"evaluate={setting!r} needs central held-out data: the task has none; give the "
                         "coordinator a file with eval-data=PATH.npz, or use evaluate='federated'")
    return setting


@dataclass
class FederatedEvaluation:
    """One step's federated evaluation: the messages, then an example-weighted sum per metric."""

    ctx: RunContext
    step: int
    examples: int = 0
    # exact sums: the row is the same whatever order the devices' figures came in
    sums: dict[str, ExactScalar] = field(default_factory=dict)
    replies: int = 0
    ignored: list[dict[str, Any]] = field(default_factory=list)

    def messages(self, model: torch.Tensor, nodes: list[int]) -> list[Outgoing]:
        config = self.ctx.round_config(self.step).to_record()
        arrays = ArrayRecord(unflatten_state(model, self.ctx.template))
        return [Outgoing(n, RecordDict({MODEL_RECORD: arrays, CONFIG_RECORD: config}), MessageType.EVALUATE)
                for n in nodes]

    def absorb(self, node: int, content: RecordDict) -> None:
        """Add one device's figures; raise :class:`Rejected` for an implausible reply."""
        if METRICS_RECORD not in content.metric_records:
            raise Rejected("evaluation reply has no metrics")
        raw = dict(content.metric_records[METRICS_RECORD])
        examples = raw.pop("num-examples", None)
        if not isinstance(examples, int) or isinstance(examples, bool) or examples <= 0:
            raise Rejected(f"evaluation num-examples must be a positive integer, got {examples!r}")
        values: dict[str, float] = {}
        for name, value in raw.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise Rejected(f"evaluation metric {name}={value!r} is not a finite number")
            values[name] = float(value)
        if "loss" not in values:
            raise Rejected(f"evaluation reply lacks the loss (got {sorted(values)})")
        if self.replies and set(values) != set(self.sums):
            raise Rejected(f"evaluation metrics {sorted(values)} differ from the other devices' {sorted(self.sums)}")
        for name, value in values.items():
            self.sums.setdefault(name, ExactScalar()).add(value * examples)
        self.examples += examples
        self.replies += 1

    def ignore(self, failure: Failure) -> None:
        """A device's evaluation left out of the mean, typed like any failed reply."""
        log.warning("step %d: evaluation from node %s left out: %s (%s)", self.step, failure.node, failure.reason,
                    failure.kind)
        self.ignored.append(failure.entry())

    def result(self) -> dict[str, float]:
        """Each metric's example-weighted mean over the devices that replied (empty if none did)."""
        if not self.replies:
            return {}
        return {name: total.value / self.examples for name, total in self.sums.items()}

    def facts(self) -> dict[str, Any]:
        """What the metrics row records about the exchange itself."""
        return {"federated_replies": self.replies, "federated_examples": int(self.examples),
                **({"federated_ignored": self.ignored} if self.ignored else {})}
