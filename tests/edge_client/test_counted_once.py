"""A device takes part in a root round through one leaf only (``fedge.edge_client.counted_once``):
the rule on the device's own node state, message by message."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from fedge.edge_client.counted_once import counted_once_mod
from fedge.protocol.refusals import BadConfigRefusal, CountedElsewhereRefusal


def _message(stamps: dict[str, object] | None, kind: str = MessageType.TRAIN) -> Message:
    config = ConfigRecord({"lr": 0.1, **(stamps or {})})
    return Message(RecordDict({"config": config}), dst_node_id=7, message_type=kind)


def _trained(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 3})}), reply_to=msg)


def _stamped(root_round: str, leaf: int) -> Message:
    return _message({"fedge.root-round": root_round, "fedge.root-leaf": leaf})


def _ask(context: Context, msg: Message) -> Message:
    return counted_once_mod(msg, context, _trained)


def test_one_root_round_through_one_leaf() -> None:
    device = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    assert not _ask(device, _stamped("9/1", 0)).has_error()
    assert not _ask(device, _stamped("9/1", 0)).has_error()  # its own leaf may ask again (several leaf steps)
    with pytest.raises(CountedElsewhereRefusal, match="root round 9/1 through leaf 0"):
        _ask(device, _stamped("9/1", 1))  # moved to leaf 1 in the same root round: declined
    assert not _ask(device, _stamped("9/2", 1)).has_error()  # the next root round, with its new leaf
    with pytest.raises(CountedElsewhereRefusal):
        _ask(device, _stamped("9/2", 0))
    assert not _ask(device, _stamped("10/2", 0)).has_error()  # another root run's round 2


def test_unstamped_and_non_train_messages_pass_and_bad_stamps_are_refused() -> None:
    device = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    assert not _ask(device, _message(None)).has_error()  # one tier: no stamps, no rule
    assert not device.state.config_records  # and nothing kept
    _ask(device, _stamped("9/1", 0))
    evaluate = _message({"fedge.root-round": "9/1", "fedge.root-leaf": 1}, kind=MessageType.EVALUATE)
    assert not _ask(device, evaluate).has_error()  # evaluation adds nothing to a round's sum
    with pytest.raises(BadConfigRefusal, match="leaf index"):
        _ask(device, _message({"fedge.root-round": "9/3", "fedge.root-leaf": "one"}))


def test_a_late_leaf_still_serving_an_older_root_round_is_declined() -> None:
    """Privacy audit 3, F8: the device remembered only its last root round, so after round 9/2
    through leaf 1, leaf 0 (late, still stepping round 9/1) could train it again for 9/1, which
    leaf 1 had already counted. It remembers a window of root rounds now; the oldest age out."""
    from fedge.edge_client.counted_once import WINDOW

    device = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    assert not _ask(device, _stamped("9/1", 1)).has_error()
    assert not _ask(device, _stamped("9/2", 1)).has_error()
    with pytest.raises(CountedElsewhereRefusal, match="root round 9/1 through leaf 1"):
        _ask(device, _stamped("9/1", 0))
    for number in range(3, WINDOW + 3):  # a window's worth of later rounds: 9/1 ages out
        assert not _ask(device, _stamped(f"9/{number}", 1)).has_error()
    assert not _ask(device, _stamped("9/1", 0)).has_error()
