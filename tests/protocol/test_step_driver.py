"""One step's driver (``fedge.coordinator.driver``): what every coordinator counts about a step's
replies, and what its layers hear, written once; driven with real Flower messages."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedge.aggregation.partial import Partial
from fedge.coordinator.driver import StepDriver
from fedge.coordinator.layer import Layer, LayerStack
from fedge.coordinator.step import Missing, Reply, Step, Update
from fedge.coordinator.tally import Tally
from fedge.protocol.failures import Failure, FailureKind, Rejected
from fedge.protocol.refusals import refusal_content
from fedge.protocol.resources import RESOURCES_RECORD, ResourceReport


pytestmark = pytest.mark.usefixtures("flower_task_identity")


class _Hearing(Layer):
    """Records every failure it hears and releases a mean of its own when asked to."""

    key = "test-hearing"

    def __init__(self, replace: bool = False) -> None:
        self.heard: list[tuple[int | None, str]] = []
        self.replace = replace

    def arrived(self, step: Step, event: Reply | Failure) -> bool:
        if isinstance(event, Failure):
            self.heard.append((event.node, event.kind.value))
        return False

    def release(self, step: Step, partial: Partial) -> Partial:
        if not self.replace:
            return partial
        return Partial.of_mean(torch.zeros(partial.numel), partial.weight, partial.count - 1,
                               members=partial.members[:-1])


def _reply(node: int, metrics: dict[str, float], content: RecordDict | None = None) -> Message:
    sent = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node, message_type=MessageType.TRAIN)
    return Message(content if content is not None else RecordDict({"metrics": MetricRecord(metrics)}), reply_to=sent)


def _update(reply: Reply) -> Update:
    return Update(reply.node, torch.ones(2), 1.0, {}, b"", reply.content)


def test_a_step_counts_used_replies_members_and_failures_once_and_every_layer_hears_each_failure() -> None:
    layer, heard = _Hearing(), []
    driver = StepDriver(LayerStack([layer]), Step(1, nodes=[1, 2, 3, 4, 5]), Tally(0.0), heard=heard.append)
    assert driver.take(_reply(1, {"train-seconds": 2.5}), _update) is None
    assert driver.take(_reply(2, {}), lambda reply: None) is None  # taken whole by a layer: used, no member
    def refuse(reply: Reply) -> Update:
        raise Rejected("not finite")

    assert driver.take(_reply(3, {}), refuse).kind is FailureKind.INVALID
    assert driver.take(Missing(4, "no reply in 5 s"), _update).kind is FailureKind.TIMEOUT
    declined = driver.take(_reply(5, {}, refusal_content("not-eligible", "on battery")), _update)
    assert declined is not None and declined.kind.declined
    tally = driver.tally
    assert (tally.used, tally.members, tally.train_seconds) == (2, [1], [2.5, 0.0])
    assert tally.failures == {"invalid": 1, "timeout": 1} and tally.declined == {"not-eligible": 1}
    assert [f.node for f in heard] == [3, 4, 5] and [n for n, _ in layer.heard] == [3, 4, 5]
    driver.step.drop(Failure(6, FailureKind.SECAGG, "dealt no shares"))  # a layer's drop: the same path
    assert tally.failures["secagg"] == 1 and heard[-1].node == 6 and layer.heard[-1] == (6, "secagg")


@pytest.mark.parametrize("replace", [False, True])
def test_the_released_aggregate_names_its_members_and_counts_the_used_replies(replace: bool) -> None:
    driver = StepDriver(LayerStack([_Hearing(replace)]), Step(1), Tally(0.0))
    for node in (7, 8, 9):
        driver.take(_reply(node, {}), _update)
    clear = Partial.of_sum(torch.ones(2) * 3, 3.0, 3)
    released = driver.release(clear)
    assert driver.clear is not None and driver.clear.members == (7, 8, 9)
    assert (released is driver.clear) is not replace  # no layer replaced it: a strategy may aggregate the replies
    assert driver.step.released is released
    assert driver.tally.used == released.count == (2 if replace else 3)
    assert driver.tally.members == list(released.members)


def test_a_flower_apps_reply_loses_its_resource_report_once_counted() -> None:
    """Flower's strategies aggregate replies holding exactly one MetricRecord; ``resource_mod`` adds one."""
    report = ResourceReport(*[1.0] * len(fields(ResourceReport)))
    content = RecordDict({"metrics": MetricRecord({"num-examples": 3}), RESOURCES_RECORD: report.record()})
    reply = _reply(3, {}, content)
    driver = StepDriver(LayerStack(), Step(1), Tally(0.0), app=True)
    assert driver.take(reply, _update) is None
    assert RESOURCES_RECORD not in reply.content.metric_records and driver.tally.reports == {3: report}
