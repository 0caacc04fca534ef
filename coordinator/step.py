"""One coordinator step as every coordinator of Fedge sees it: the messages it sends, the replies
it takes, the updates it decodes, and the step's own state and outcome.

Fedge's engine (``fedge.server.engine``) drives an algorithm's steps with these types, and its
layers (``fedge.coordinator.layer``) act on them; ``fedge.flower.layered`` builds the same values
around a user's Flower strategy, so that one layer class works in both coordinators. They live
here, not in the engine, for that reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import Message, RecordDict

from fedge.aggregation.partial import Accumulator, Partial
from fedge.protocol.failures import Failure

__all__ = ["Exchange", "Missing", "Outgoing", "Reply", "Step", "StepOutcome", "Update"]


@dataclass(frozen=True)
class Missing:
    """A message that got no reply within its time: its node and why (what an exchange yields in
    place of the reply)."""

    node: int
    reason: str


@dataclass
class Outgoing:
    """One message an algorithm wants sent: the engine wraps it into a Flower ``Message``."""

    node: int
    content: RecordDict
    message_type: str
    #: the flat model this message carries to the device, when it carries one (FedAvg's global
    #: model, EASGD's center): the downlink layer ships it, in full or as a lattice change
    model: torch.Tensor | None = None


@dataclass
class Reply:
    """A reply that is not a Flower error: its node and content."""

    node: int
    content: RecordDict
    #: asynchronous algorithms: the model version the reply's message was built from
    started: int | None = None
    #: seconds from its message's creation to the reply's, by the two messages' own timestamps (set
    #: by ``fedge.flower.layered``, which sees replies only after the round's barrier, as Flower's TTL
    #: check reads them); None: the coordinator times the reply as it lands
    seconds: float | None = None
    #: what the door read from it, for the layers' ``arrived``: its payload and checked metrics
    payload: memoryview | None = None
    metrics: dict[str, float] | None = None


#: a coordinator's message exchange with its devices: (messages, timeout seconds, group name) ->
#: each reply as it lands, or a :class:`Missing` for a node that did not answer in time
Exchange = Callable[[list[Outgoing], float, str], Iterable["Message | Missing"]]


def _no_exchange(outgoing: list[Outgoing], timeout: float, group: str) -> Iterable[Message | Missing]:
    raise RuntimeError("this step was opened without an exchange: its driver talks to no devices")


@dataclass
class Step:
    """One step's accumulators: :meth:`Algorithm.open_step` makes it, the other calls of the step act
    on it, and it is dropped when the step closes. Algorithms subclass it with their own fields."""

    #: the round (synchronous) or the model version being built (asynchronous: version + 1)
    number: int
    #: the nodes selected for the step (empty for asynchronous steps: nodes come and go); a layer
    #: may narrow it before the algorithm configures (secure aggregation: those that dealt shares)
    nodes: list[int] = field(default_factory=list)
    #: algorithms whose ``aggregate`` is ``mean`` or ``sum``: the step's accumulator of clear updates
    #: (a streaming mean or a robust rule); the algorithm adds to it, nothing else touches it
    aggregate: Accumulator | None = None
    #: what the step releases: the accumulator's partial after every layer's ``release`` (the
    #: unmasked sum of secure aggregation, DP's noised mean); the engine sets it before ``close``
    released: Partial | None = None
    #: nodes connected when the step opened (set by the engine)
    connected: int = 0
    #: each layer's state for this step, by layer key (``Layer.scratch``)
    layers: dict[str, Any] = field(default_factory=dict)
    #: how a layer talks to the step's devices itself (secure aggregation's key agreement and
    #: unmasking): the driver that opened the step sets it, over its dispatcher or the user's grid
    exchange: Exchange = _no_exchange
    #: where a node a layer dropped from the step goes (:meth:`drop`): the driver counts it and the
    #: algorithm and every layer hear of it; unset, a drop is an error
    on_failure: Callable[[Failure], None] | None = None

    def drop(self, failure: Failure) -> None:
        """A layer dropped ``failure.node`` from the step (it did not deal its shares, say)."""
        if self.on_failure is None:
            raise RuntimeError(f"step {self.number} dropped node {failure.node} but its driver hears no failures")
        self.on_failure(failure)

    def aggregated(self) -> Partial:
        """The step's aggregate as the algorithm closes it: what the layers released, or (an
        algorithm driven without the engine, in a unit test) its accumulator's own partial."""
        if self.released is not None:
            return self.released
        if self.aggregate is None:
            raise ValueError("this step has no aggregate: its algorithm works on each update")
        return self.aggregate.partial()


@dataclass(frozen=True)
class Update:
    """A reply the engine has screened, decoded with its round's codec and bounded, for
    :meth:`Algorithm.absorb`."""

    node: int
    #: the decoded update, within the run's norm bound
    vector: torch.Tensor
    #: the (capped) example count; 1.0 for algorithms that do not weight replies
    weight: float
    #: the reply's metrics, with ``num-examples`` and ``train-loss`` checked
    metrics: dict[str, float]
    #: the encoded bytes as the client sent them (gossip relays them unchanged)
    payload: bytes
    #: the whole reply, for records only one algorithm reads (gossip's ``measure``)
    content: RecordDict
    #: asynchronous algorithms: the model version the reply's message was built from
    started: int | None = None

    @property
    def train_loss(self) -> float:
        return float(self.metrics.get("train-loss", 0.0))


@dataclass
class StepOutcome:
    """How a step ended. ``model`` is what the engine evaluates on held-out data (FedAvg's global
    model, EASGD's center, gossip's average); ``extra`` goes into the metrics row."""

    model: torch.Tensor | None
    train_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[dict[str, Any]] = field(default_factory=list)  # step-level problems, e.g. non-finite aggregate
