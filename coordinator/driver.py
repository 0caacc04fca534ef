"""One step's driver: open, take each reply through the door, release, close.

Every coordinator of Fedge drives its steps with this one object: the engine's synchronous and
asynchronous loops and its federated evaluation, and the Flower-app wrappers (``layered``'s train
and evaluate rounds, ``FedBuff``'s versions). What a step counts about its replies (bytes, used,
whose updates, failures by kind) and what its layers hear (every failure, the released aggregate,
the close) is therefore written once, here; a driver only says what taking one reply means to
it (``consume``: the engine's algorithm, a Flower strategy's model, a buffer).
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Message

from fedge.aggregation.partial import Partial
from fedge.coordinator.door import door
from fedge.coordinator.layer import LayerStack
from fedge.coordinator.step import Missing, Outgoing, Reply, Step, StepOutcome, Update
from fedge.coordinator.tally import Tally, train_seconds
from fedge.protocol.failures import Failure
from fedge.protocol.resources import RESOURCES_RECORD

__all__ = ["StepDriver"]


class StepDriver:
    """The accounting of one ``step`` around the door (``fedge.coordinator.door``), counted in its
    ``tally`` and heard by its ``layers``. ``heard``: what the driver itself does with a failure
    (the engine's algorithm forgets the node's slot; a Flower wrapper lists the refusal), called
    before the layers hear it. ``app``: the replies come from a Flower app, whose strategies take
    exactly one MetricRecord per reply, so the device's resource report is taken out once counted."""

    def __init__(self, layers: LayerStack, step: Step, tally: Tally, *,
                 heard: Callable[[Failure], None] | None = None, app: bool = False) -> None:
        self.layers, self.step, self.tally, self.heard, self.app = layers, step, tally, heard, app
        #: the clear aggregate as it entered the layers' ``release`` (``released is clear``: no layer
        #: put its own in its place, so a Flower strategy may aggregate the replies themselves)
        self.clear: Partial | None = None
        step.on_failure = self.fail  # a node a layer drops (no shares dealt) is a failure like any other

    def send(self, outgoing: list[Outgoing]) -> None:
        """The step's messages through every layer (which may keep some back); those that go are counted."""
        self.layers.outgoing(self.step, outgoing)
        self.tally.sent(outgoing)

    def take(self, item: Message | Missing, consume: Callable[[Reply], Update | None], started: int | None = None,
             what: str = "update") -> Failure | None:
        """One reply (or a :class:`Missing`) through the door: its bytes and resource report counted
        as it arrives; ``consume`` uses it (returning the update it absorbed, or None when a layer took
        it whole or it carries none: an evaluation) or raises what refuses it. None when it was used,
        else the :class:`Failure` every layer heard."""
        if not isinstance(item, Missing):
            self.tally.replied(item)
            if self.app and not item.has_error():
                item.content.pop(RESOURCES_RECORD, None)
        taken: list[Update | None] = []
        failure = door(self.step.number, item, lambda reply: taken.append(consume(reply)), started, what)
        if failure is not None:
            self.fail(failure)
            return failure
        assert not isinstance(item, Missing)
        self.tally.used += 1
        self.tally.train_seconds.append(train_seconds(item))
        if taken[0] is not None:  # an update in the step's clear aggregate: its node is a member
            self.tally.members.append(taken[0].node)
        return None

    def fail(self, failure: Failure) -> None:
        """A node gave no usable reply, or a layer dropped it: the driver, then every layer, hear why."""
        if self.heard is not None:
            self.heard(failure)
        self.tally.failed(failure)
        self.layers.failed(self.step, failure)

    def release(self, partial: Partial) -> Partial:
        """The step's clear aggregate (its members: the nodes whose updates it holds) through every
        layer's ``release``; what comes out is the step's (``step.released``) and its count the
        step's used replies (a masked round's survivors, not the uploads that arrived)."""
        self.clear = partial = partial.replace(members=tuple(self.tally.members))
        released = self.step.released = self.layers.release(self.step, partial)
        self.tally.used, self.tally.members = released.count, list(released.members)
        return released

    def close(self, outcome: StepOutcome) -> None:
        self.layers.close(self.step, outcome, self.tally)
