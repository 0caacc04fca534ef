"""``LayerStack``: how the layers' hooks compose, written once for every driver (the engine,
``fedge.flower.layered``, ``fedge.flower.FedBuff``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flwr.app import RecordDict

from fedge.aggregation.partial import Partial
from fedge.protocol.failures import Failure, FailureKind
from fedge.coordinator.driver import StepDriver
from fedge.coordinator.layer import SAMPLE, SUM, Layer, LayerStack, RunComplete
from fedge.coordinator.step import Reply, Step, StepOutcome, Update
from fedge.coordinator.tally import Tally


class _Recording(Layer):
    """A layer that records every hook it sees in a shared log, under its key."""

    def __init__(self, key: str, log: list[str], *, chooses: list[int] | None = None, consumes: bool = False,
                 scale: float = 1.0, state: Any = None, provides: frozenset[str] = frozenset(),
                 needs: frozenset[str] = frozenset()) -> None:
        self.key, self.log, self.chooses, self.consumes = key, log, chooses, consumes
        self.scale, self.state = scale, state
        self.provides, self.needs = provides, needs
        self.loaded: Any = "never"

    def select(self, nodes: list[int], count: int, key: int) -> list[int] | None:
        self.log.append(f"{self.key}.select")
        return self.chooses

    def arrived(self, step: Step, event: Reply | Failure) -> bool:
        if isinstance(event, Failure):
            self.log.append(f"{self.key}.missed:{event.kind.value}")
            return False
        self.log.append(f"{self.key}.arrived")
        return self.consumes

    def update(self, step: Step, update: Update) -> Update:
        self.log.append(f"{self.key}.update")
        return Update(update.node, update.vector * self.scale, update.weight, update.metrics, update.payload,
                      update.content)

    def release(self, step: Step, partial: Partial) -> Partial:
        self.log.append(f"{self.key}.release")
        return Partial.of_sum(partial.sum() * self.scale, partial.weight, partial.count)

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.loaded = state


def _update() -> Update:
    return Update(1, torch.ones(3), 1.0, {}, b"", RecordDict())


def test_layers_run_in_the_order_their_declarations_imply_whatever_order_they_come_in() -> None:
    log: list[str] = []
    noise = _Recording("a-noise", log, needs=frozenset({SUM}))
    secure = _Recording("z-sum", log, provides=frozenset({SUM}))
    stack = LayerStack([noise, secure])
    assert [layer.key for layer in stack] == ["z-sum", "a-noise"]
    stack.release(Step(1), Partial.of_sum(torch.ones(3), 1.0, 1))
    assert log == ["z-sum.release", "a-noise.release"]


def test_the_first_layer_that_chooses_chooses_and_a_forbidden_step_raises() -> None:
    log: list[str] = []
    stack = LayerStack([_Recording("a", log), _Recording("b", log, chooses=[7], provides=frozenset({SAMPLE})),
                        _Recording("c", log, chooses=[9])])
    assert stack.select([7, 8, 9], 1, 0) == [7] and log == ["a.select", "b.select"]
    assert LayerStack([_Recording("a", [])]).select([1, 2], 1, 0) is None  # nobody chooses: the driver samples

    class _Spent(Layer):
        key = "spent"

        def select(self, nodes: list[int], count: int, key: int) -> list[int] | None:
            raise RunComplete("budget spent")

    with pytest.raises(RunComplete, match="budget spent"):
        LayerStack([_Spent()]).select([1, 2], 1, 0)


def test_every_layer_sees_a_reply_even_one_another_consumes_and_updates_chain() -> None:
    log: list[str] = []
    stack = LayerStack([_Recording("a", log, consumes=True), _Recording("b", log)])
    decoded: list[bool] = []
    assert stack.through(Step(1), Reply(1, RecordDict()), memoryview(b""), {},
                         lambda: decoded.append(True) or _update()) is None
    assert log == ["a.arrived", "b.arrived"] and decoded == []  # consumed whole: nothing decoded

    log.clear()
    stack = LayerStack([_Recording("a", log, scale=2.0), _Recording("b", log, scale=3.0)])
    update = stack.through(Step(1), Reply(1, RecordDict()), memoryview(b""), {}, _update)
    assert update is not None and torch.equal(update.vector, torch.full((3,), 6.0))
    assert log == ["a.arrived", "b.arrived", "a.update", "b.update"]


def test_a_failure_is_counted_once_and_heard_by_every_layer() -> None:
    log: list[str] = []
    stack, tally = LayerStack([_Recording("a", log), _Recording("b", log)]), Tally(0.0)
    StepDriver(stack, Step(1), tally).fail(Failure(4, FailureKind.TIMEOUT, "no reply"))
    assert tally.failures == {"timeout": 1} and log == ["a.missed:timeout", "b.missed:timeout"]


def test_state_is_kept_by_key_and_a_layer_with_nothing_to_keep_has_no_entry() -> None:
    kept, empty = _Recording("kept", [], state={"x": 1}), _Recording("empty", [], state=None)
    stack = LayerStack([kept, empty])
    assert stack.state_dict() == {"kept": {"x": 1}}
    stack.load_state_dict({"kept": {"x": 2}})
    assert kept.loaded == {"x": 2} and empty.loaded is None  # no entry: the layer is told None
    assert stack.get("kept") is kept and stack.get("missing") is None


def test_a_step_hands_a_dropped_node_to_its_driver_and_refuses_one_without() -> None:
    heard: list[Failure] = []
    step = Step(3, on_failure=heard.append)
    step.drop(Failure(5, FailureKind.SECAGG, "no shares"))
    assert [f.node for f in heard] == [5]
    with pytest.raises(RuntimeError, match="hears no failures"):
        Step(3).drop(Failure(5, FailureKind.SECAGG, "no shares"))
    with pytest.raises(RuntimeError, match="without an exchange"):
        list(Step(3).exchange([], 1.0, "test"))
    outcome = StepOutcome(model=None)
    LayerStack([]).close(Step(3), outcome, Tally(0.0))  # no layers: nothing happens
    assert outcome.extra == {}
