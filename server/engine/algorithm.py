"""The algorithm protocol: what a round algorithm (FedAvg, EASGD, gossip, ...) owns.

The engine (``fedge.server.engine``) owns everything every algorithm shares: waiting for nodes, sampling,
pushing messages and pulling replies, timeouts, byte accounting, held-out evaluation, the metrics
log, checkpoints and resume. An algorithm owns the policy, in the shape of Flower's strategies
(``configure_train`` / ``aggregate_train``) but streaming:

* :meth:`Algorithm.configure` builds one step's messages for the selected nodes;
* :meth:`Algorithm.absorb` takes **one** reply as it arrives (decode into an accumulator, drop it),
  raising :class:`Rejected` with a reason for a reply it cannot use;
* :meth:`Algorithm.close` ends the step and returns the model the engine evaluates on held-out data;
* :meth:`Algorithm.state_dict` / :meth:`Algorithm.load_state_dict` hold everything a resumed run
  needs, validated on load (the checkpoint stores it).

Algorithms are chosen by spec string through the grammar codecs use, ``easgd:alpha=0.05,beta=0.9``,
and registered in :data:`ALGORITHMS` (``fedge.server.algorithms`` fills it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from flwr.app import RecordDict

from fedge.compression import Codec, make_codec
from fedge.protocol import METRICS_RECORD
from fedge.protocol.round_config import RoundConfig
from fedge.server.settings import RunSettings
from fedge.tasks import Task, tensor_sizes

__all__ = [
    "Algorithm",
    "Outgoing",
    "Rejected",
    "Reply",
    "RunContext",
    "StepOutcome",
    "reply_metrics",
]


class Rejected(ValueError):
    """A reply the algorithm cannot use; the message is the reason recorded in the metrics."""


@dataclass(frozen=True)
class RunContext:
    """What the engine hands an algorithm: the run's settings, task and model layout."""

    settings: RunSettings
    task: Task
    template: dict[str, torch.Tensor]  # the model's state dict (shapes, dtypes, order)
    numel: int  # floating-point elements of the model: the length of every flat vector
    fp32_bytes: int  # one fp32 model as a Flower ArrayRecord: the baseline of compression ratios
    nodes_expected: int  # clients the run was configured for (clients-per-round)

    @property
    def codec(self) -> Codec:
        return make_codec(self.settings.codec).for_model(tensor_sizes(self.template))

    def evaluate(self, flat: torch.Tensor) -> tuple[float, float]:
        """(loss, accuracy) of a flat model on the task's held-out split."""
        from fedge.tasks import evaluate, unflatten_state

        model = self.task.build_model()
        model.load_state_dict(unflatten_state(flat, self.template))
        return evaluate(model, self.task.test_data())

    def round_config(self, step: int, **extra: Any) -> RoundConfig:
        """The common part of every train message's config, plus an algorithm's own keys."""
        s = self.settings
        return RoundConfig(
            round=step, task=self.task.spec, partitioning=s.partitioning, codec=self.codec.spec,
            error_feedback=s.error_feedback, local_epochs=s.local_epochs, batch_size=s.batch_size,
            lr=s.lr, momentum=s.momentum, seed=s.seed, extra=extra,
        )


@dataclass
class Outgoing:
    """One message an algorithm wants sent: the engine wraps it into a Flower ``Message``."""

    node: int
    content: RecordDict
    message_type: str


@dataclass
class Reply:
    """A reply that is not a Flower error: its node and content."""

    node: int
    content: RecordDict
    #: asynchronous algorithms: the model version the reply's message was built from
    started: int | None = None


@dataclass
class StepOutcome:
    """How a step ended. ``model`` is what the engine evaluates on held-out data (FedAvg's global
    model, EASGD's center, gossip's average); ``extra`` goes into the metrics row."""

    model: torch.Tensor | None
    train_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[dict[str, Any]] = field(default_factory=list)  # step-level problems, e.g. non-finite aggregate


class Algorithm(ABC):
    """Base class of a round algorithm; subclasses are one file each in ``fedge.server.algorithms``."""

    #: name in spec strings and in the checkpoint; also the Flower action of its train messages
    name: ClassVar[str]
    #: asynchronous algorithms (FedBuff) are driven by ``Engine`` one reply at a time: they answer
    #: :meth:`ready` and the engine closes a step whenever it is True
    asynchronous: ClassVar[bool] = False
    #: asynchronous algorithms: how many clients to keep training at once
    concurrency: int = 0

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    @property
    @abstractmethod
    def spec(self) -> str:
        """Canonical spec with every parameter spelled out (stored in the checkpoint)."""

    # -- lifecycle ------------------------------------------------------------------------------
    @abstractmethod
    def start(self, params: torch.Tensor) -> None:
        """A fresh run from the initial model ``params`` (flat float32)."""

    def nodes_needed(self) -> int:
        """Nodes the run waits for at start (sampling algorithms: clients-per-round)."""
        return self.ctx.settings.clients_per_round

    def select(self, step: int, nodes: list[int], sample: Callable[[list[int], int], list[int]]) -> list[int]:
        """The nodes that take part in ``step``; by default a seeded sample of the connected ones."""
        return sample(nodes, step)

    @abstractmethod
    def configure(self, step: int, nodes: list[int]) -> list[Outgoing]:
        """The step's messages."""

    @abstractmethod
    def absorb(self, step: int, reply: Reply) -> None:
        """Use one reply (raise :class:`Rejected` with the reason if it cannot be used)."""

    def missed(self, step: int, node: int, reason: str) -> None:
        """``node`` gave no usable reply this step (timeout, client error, or rejected)."""

    @abstractmethod
    def close(self, step: int) -> StepOutcome:
        """End the step: apply what was absorbed."""

    def ready(self) -> bool:
        """Asynchronous algorithms: whether enough was absorbed to close the step now."""
        return False

    def evaluation(self, step: int, nodes: list[int]) -> list[Outgoing]:
        """Optional second exchange of the step (federated evaluation); none by default."""
        return []

    def absorb_evaluation(self, step: int, reply: Reply) -> None:
        raise Rejected("this algorithm sends no evaluation messages")

    def close_evaluation(self, step: int) -> dict[str, Any]:
        return {}

    @abstractmethod
    def final_model(self) -> torch.Tensor:
        """The run's model for ``model.pt`` and the edge bundle."""

    def describe(self) -> dict[str, Any]:
        """Facts worth keeping in the run directory (``algorithm.json``)."""
        return {"algorithm": self.spec}

    # -- state ----------------------------------------------------------------------------------
    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: tensors, numbers, strings, lists and dicts of them."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; raise ``ValueError`` if it does not fit this run."""

    # -- helpers for subclasses -----------------------------------------------------------------
    def check_flat(self, tensor: Any, what: str) -> torch.Tensor:
        """A checkpointed flat model vector: right size, float32, finite."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.numel() != self.ctx.numel:
            raise ValueError(f"{what} is not a flat vector of {self.ctx.numel} elements")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{what} holds NaN or infinite values")
        return tensor.to(torch.float32).clone()


def reply_metrics(content: RecordDict, require_examples: bool = True) -> dict[str, float]:
    """The reply's MetricRecord, with the fields every algorithm relies on checked:
    ``num-examples`` a positive integer, ``train-loss`` (if present) finite."""
    if METRICS_RECORD not in content.metric_records:
        raise Rejected(f"reply has no {METRICS_RECORD!r} MetricRecord")
    metrics = dict(content.metric_records[METRICS_RECORD])
    examples = metrics.get("num-examples")
    if require_examples and (not isinstance(examples, int) or isinstance(examples, bool) or examples <= 0):
        raise Rejected(f"num-examples must be a positive integer, got {examples!r}")
    loss = metrics.get("train-loss", 0.0)
    if not isinstance(loss, (int, float)) or isinstance(loss, bool) or not torch.isfinite(torch.tensor(float(loss))):
        raise Rejected(f"train-loss must be a finite number, got {loss!r}")
    return metrics


def finite_or_previous(new: torch.Tensor, old: torch.Tensor, step: int) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Each reply was finite, but their aggregate can still overflow float32 (a client sent values
    near the float32 limit): keep the previous model rather than poison every later round."""
    if bool(torch.isfinite(new).all()):
        return new, []
    import logging

    logging.getLogger(__name__).error("round %d: the aggregated model is not finite; model unchanged", step)
    return old, [{"node": None, "reason": "aggregate not finite; round skipped"}]
