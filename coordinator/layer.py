"""The layer interface: a cross-cutting feature the engine holds around every algorithm.

Differential privacy, secure aggregation, the downlink codec, the update guard and the model
average each change what every algorithm's steps send, receive or deliver, yet none of them is any
algorithm's business. Each is one :class:`Layer`, one file in this package, and the engine calls
every layer at the same points of a step, the way PyTorch's ``fp16_compress_wrapper`` wraps any DDP
comm hook and a Flower mod wraps any ClientApp.

Which layer runs before which follows from what each declares, never from a list's order: a layer
names the facets of a step it ``provides`` (``SUM``: it produces the step's sum) and those it
``needs`` done first (DP clips after the guard has bounded and weighed an update, and noises the
sum secure aggregation unmasked). :func:`order_layers` sorts the run's
layers by these declarations, and refuses, before the run, two layers that provide one facet or a
cycle. The step's aggregate travels between them as one typed value, a
:class:`~fedge.aggregation.partial.Partial`, through :meth:`Layer.release`. Every driver holds the
run's layers as one :class:`LayerStack`, which writes down once how each hook composes.

Six hooks, in a step's order: the selection (``select``), what goes out (``outgoing``), each
reply or failure (``arrived``, ``update``) and the step's close (``release``, ``close``); around
them the run's state (``state_dict``, ``load_state_dict``). A layer that needs the model's size
takes it at construction or from the first message's model.

============  ============================================================================
hook          when (and what it may do)
============  ============================================================================
``build``     before the run starts: the layer for this algorithm and settings, ``None``
              when its setting is off; raises ``SettingsError`` with the reason when it
              cannot work with this algorithm (the one place its refusals live)
``select``    choosing ``count`` of the nodes for a step, or of the free nodes for an
              asynchronous dispatch (``key``: the step or dispatch): may replace the engine's
              seeded sample (Poisson under DP, Oort's rule); raises :class:`RunComplete`
              when no step may run any more (a spent privacy budget)
``outgoing``  every message the algorithm built, before it is sent: writes into it, or keeps
              it back (removed from the list: not sent, not waited for), after exchanges of
              its own over ``step.exchange`` if it needs them (secure aggregation's key
              agreement); a node it drops for a reason goes to ``step.drop`` as a
              :class:`Failure`
``arrived``   every reply that passed the screen (``reply.payload``, ``reply.metrics``: what
              the door read), before anything is decoded; every layer sees it, and one that
              consumes it whole (a masked upload) returns True, which ends the door there. Or
              a :class:`Failure`: the node gave no usable reply (it says why, by kind)
``update``    every decoded update, before the algorithm absorbs it: bound, clip, reweight
``release``   after the replies, the step's aggregate, a :class:`Partial`, on its way to the
              algorithm: a chain, each layer returns the partial the next receives (secure
              aggregation unmasks the survivors' sum over ``step.exchange`` and puts it in
              place of the clear one, DP noises it)
``close``     after the algorithm closed the step: rewrite the outcome, add the row's fields
============  ============================================================================

What a layer keeps for one step lives in ``step.layers[layer.key]`` (dropped with the step);
what persists lives on the layer and in its ``state_dict``, checkpointed under ``layer.key``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar


from fedge.aggregation.partial import Partial
from fedge.protocol.failures import Failure
from fedge.coordinator.step import Exchange, Outgoing, Reply, Step, StepOutcome, Update
from fedge.coordinator.tally import Tally

__all__ = ["BOUNDED", "MEMBERS", "MODEL", "NOISE", "SAMPLE", "SUM", "Exchange", "Failure", "Layer",
           "LayerOrderError", "LayerStack", "RunComplete", "order_layers", "releases_aggregate"]

#: the facets of a step a layer may provide or need (``Layer.provides``, ``Layer.needs``)
#: chooses the step's devices (``select``, ``choose``): Oort's rule, DP's Poisson sample
SAMPLE = "sample"
#: bounds and weighs each decoded update (``update``)
BOUNDED = "bounded-update"
#: decides which of the step's messages go out (``outgoing``): secure aggregation keeps back those
#: of the devices that dealt no shares, so what counts or encodes each message runs after it
MEMBERS = "members"
#: puts the step's model into each message (``outgoing``)
MODEL = "model"
#: produces the step's sum in place of the clear one (``release``): secure aggregation
SUM = "sum"
#: adds noise to the released aggregate (``release``)
NOISE = "noise"

class LayerOrderError(ValueError):
    """Layers that cannot run together: two provide one facet, or their needs form a cycle."""


class RunComplete(Exception):
    """Raised by a layer's ``select``: no step may run any more (its privacy budget is spent). The
    run ends complete before the step, as it would after its last round; the driver logs why."""

    @classmethod
    def budget_spent(cls, epsilon: float, delta: float) -> RunComplete:
        return cls(f"privacy budget: one more round would spend more than epsilon={epsilon:g} (delta={delta:g})")


class Layer:
    """Base class of the engine's layers; every hook's default does nothing."""

    #: the layer's name: its checkpoint key and its key in ``step.layers``
    key: ClassVar[str]
    #: the facets this layer's hooks provide: two layers of one run never provide the same one (an
    #: instance may narrow it: uniform selection only counts, it chooses nothing)
    provides: frozenset[str] = frozenset()
    #: the facets whose providers (when the run has them) must run before this layer's hooks
    needs: frozenset[str] = frozenset()

    @classmethod
    def build(cls, algorithm: Any, run_dir: Any = None) -> Layer | None:
        """The layer for Fedge's engine running ``algorithm`` (``fedge.server.engine.algorithm``), or
        None when its setting is off. In a Flower app a layer is made directly and handed to
        ``fedge.flower.layered``."""
        raise NotImplementedError

    def scratch(self, step: Step, factory: Callable[[], Any]) -> Any:
        """This layer's per-step state, made by ``factory`` on first use."""
        if self.key not in step.layers:
            step.layers[self.key] = factory()
        return step.layers[self.key]

    # -- a step, in order ---------------------------------------------------------------------
    def select(self, nodes: list[int], count: int, key: int) -> list[int] | None:
        return None

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        pass

    def arrived(self, step: Step, event: Reply | Failure) -> bool:
        return False

    def update(self, step: Step, update: Update) -> Update:
        return update

    def release(self, step: Step, partial: Partial) -> Partial:
        return partial

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        pass

    # -- the run ------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Facts for the run directory's ``algorithm.json``."""
        return {}

    def state_dict(self) -> dict[str, Any] | None:
        """What a resumed run needs (``None``: nothing; the checkpoint then holds no entry)."""
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output (``None`` when the checkpoint has no entry for this
        layer); raise ``ValueError`` when it does not fit this run."""


def releases_aggregate(layer: Layer) -> bool:
    """Whether ``layer`` puts its own aggregate in place of the clear sum (its ``release`` hook:
    secure aggregation, DP, EASGD's center step): a driver that never releases a whole round's
    aggregate (FedBuff's) cannot run it, and a Flower strategy must step from that one mean."""
    return type(layer).release is not Layer.release


class LayerStack:
    """A run's layers composed into one, in the order their declarations imply
    (:func:`order_layers`, which refuses what cannot run together): every driver, Fedge's engine and
    the wrappers of ``fedge.flower``, calls this, so how the hooks compose is written once. ``select``:
    the first layer that chooses; ``arrived``: every layer sees the reply; ``update`` and ``release``:
    chains, each layer's result the next one's input; every other hook: each layer in turn."""

    def __init__(self, layers: Iterable[Layer] = ()) -> None:
        self.layers = order_layers(list(layers))

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def get(self, key: str) -> Layer | None:
        """The layer named ``key`` (``dp``, ``downlink``, ...), or None when the run has none."""
        return next((layer for layer in self.layers if layer.key == key), None)

    @property
    def releasing(self) -> list[str]:
        """The keys of the layers that put their own aggregate in place of the clear sum."""
        return [layer.key for layer in self.layers if releases_aggregate(layer)]

    def select(self, nodes: list[int], count: int, key: int) -> list[int] | None:
        """The first layer's choice (Poisson under DP, Oort's rule), or None: the driver samples.
        Raises :class:`RunComplete` when a layer forbids the step."""
        for layer in self.layers:
            chosen = layer.select(list(nodes), count, key)
            if chosen is not None:
                return chosen
        return None

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        """Every layer in turn; the step's nodes then lose those whose message a layer kept back (a
        driver waits for no reply from them)."""
        addressed = {o.node for o in outgoing}
        for layer in self.layers:
            layer.outgoing(step, outgoing)
        going = {o.node for o in outgoing}
        step.nodes = [n for n in step.nodes if n in going or n not in addressed]

    def through(self, step: Step, reply: Reply, payload: memoryview, metrics: dict[str, float],
                decode: Callable[[], Update]) -> Update | None:
        """The layers' part of the one door every update passes, in every driver: every layer sees
        the reply as it arrived, before anything is decoded (one may take it whole, a masked upload:
        then None); ``decode`` makes its update (raising what refuses the reply: the algorithm's
        admission, the codec's checks); every layer's ``update`` then bounds, clips or reweighs it."""
        reply = dataclasses.replace(reply, payload=payload, metrics=metrics)
        if any([layer.arrived(step, reply) for layer in self.layers]):  # every layer sees it
            return None
        update = decode()
        for layer in self.layers:
            update = layer.update(step, update)
        return update

    def failed(self, step: Step, failure: Failure) -> None:
        """A node gave no usable reply (``failure`` says why, by kind): every layer hears it (the
        step's driver counts it, ``fedge.coordinator.driver``)."""
        for layer in self.layers:
            layer.arrived(step, failure)

    def release(self, step: Step, partial: Partial) -> Partial:
        for layer in self.layers:
            partial = layer.release(step, partial)
        return partial

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        for layer in self.layers:
            layer.close(step, outcome, tally)

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {}
        for layer in self.layers:
            described.update(layer.describe())
        return described

    def state_dict(self) -> dict[str, Any]:
        """Each layer's state under its key (a layer with nothing to keep has no entry)."""
        return {layer.key: saved for layer in self.layers if (saved := layer.state_dict()) is not None}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for layer in self.layers:
            layer.load_state_dict(states.get(layer.key))


def order_layers(layers: list[Layer]) -> list[Layer]:
    """The run's layers in the order their declarations imply: every provider of a facet a layer
    needs runs before it; among layers that do not depend on each other, by key (so the order
    never depends on registration). Two layers that provide one facet (two rules choosing the
    step's devices) or a cycle of needs raise :class:`LayerOrderError` with the reason: the one place where
    a combination of layers that cannot work is refused, before any process starts."""
    providers: dict[str, Layer] = {}
    for layer in sorted(layers, key=lambda layer: layer.key):
        for facet in sorted(layer.provides):
            if facet in providers:
                raise LayerOrderError(f"{providers[facet].key} and {layer.key} both provide the step's {facet!r}: "
                                    "a run can have one of them; turn the other off")
            providers[facet] = layer
    before = {layer.key: {providers[f].key for f in layer.needs if f in providers} - {layer.key} for layer in layers}
    ordered: list[Layer] = []
    waiting = sorted(layers, key=lambda layer: layer.key)
    while waiting:
        done = {layer.key for layer in ordered}
        ready = next((layer for layer in waiting if before[layer.key] <= done), None)
        if ready is None:
            cycle = ", ".join(f"{layer.key} needs {sorted(before[layer.key] - done)}" for layer in waiting)
            raise LayerOrderError(f"the layers' needs form a cycle: {cycle}")
        ordered.append(ready)
        waiting.remove(ready)
    return ordered
