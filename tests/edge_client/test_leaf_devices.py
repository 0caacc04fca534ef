"""``leaf_devices_mod``: a simulated leaf's node trains as the device it stands for."""

from __future__ import annotations

from flwr.app import Context, Message, RecordDict

from fedge.edge_client.leaf_devices import LEAF_NODE, leaf_devices_mod


def _seen(run_config: dict, node_config: dict, messages: int = 1) -> list[dict]:
    """The node config each of ``messages`` messages reaches the handler with (one node's context)."""
    context = Context(run_id=1, node_id=7, node_config=dict(node_config), state=RecordDict(), run_config=run_config)
    seen: list[dict] = []

    def handler(msg: Message, ctx: Context) -> Message:
        seen.append(dict(ctx.node_config))
        return msg

    for _ in range(messages):
        leaf_devices_mod(Message(RecordDict(), dst_node_id=7, message_type="train"), context, handler)
    return seen


def test_a_simulated_node_becomes_its_device_once_for_every_message() -> None:
    """Flower's node 1 of 2 in leaf 1 of 2 over 4 devices is the device of partition 3 of 4, at its
    first message and every later one (Flower keeps the context: it is not mapped again)."""
    seen = _seen({"leaf-devices": "1/2/4"}, {"partition-id": 1, "num-partitions": 2}, messages=3)
    assert seen == [{"partition-id": 3, "num-partitions": 4, LEAF_NODE: 1}] * 3


def test_a_node_of_a_run_without_the_setting_keeps_its_own_config() -> None:
    config = {"partition-id": 5, "num-partitions": 8, "cache-dir": "/x"}
    assert _seen({"leaf-devices": ""}, config) == [config]
    assert _seen({}, config) == [config]
