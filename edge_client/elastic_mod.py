"""Elastic averaging (EASGD) on a node: ``elastic_mod`` around Fedge's FedAvg handler (in Fedge's
ClientApp) and around a Flower app's own body alike, with :class:`ElasticNode`, the node's own
model x_i and its elastic step.

The node keeps its own model x_i between rounds (in its ``Context`` state). On a train message that names the elastic coupling α
(``fedge.coordinator.elastic_layer`` writes it), the mod hands the user's ``@app.train()`` body x_i in
place of the center x̃ the message brought (the center itself the first time), then takes what it
trained through the elastic step both coordinators share (``fedge.aggregation.elastic``): it keeps
x_i − δ_i and replies x̃ + δ_i, so that the update any outer mod or the strategy computes (reply
minus message) is δ_i = α(x_i − x̃). The reply's metrics gain ``center-distance`` (‖x_i − x̃‖).

It goes last in the ClientApp's mods, next to the body: ``ClientApp(mods=[compression_mod,
elastic_mod])``, so that ``compression_mod`` encodes δ_i and its lattice downlink has rebuilt x̃
first. A message without the coupling passes through unchanged. A Fedge handler's update
(``edge_client.device_update``) is stepped the same way and handed on to the outer mods, with the
node's own model measured (``local-score``).
"""

from __future__ import annotations

import math

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fedge.aggregation.elastic import elastic_difference
from fedge.edge_client import local
from fedge.edge_client.device_update import DeviceUpdate, hand_off, take_update
from fedge.edge_client.node_store import NodeStore
from fedge.protocol.config_keys import EASGD_ALPHA
from fedge.protocol.layout import Layout, LayoutError
from fedge.protocol.records import MODEL_RECORD, ProtocolError
from fedge.protocol.secagg import SECAGG_RECORD
from fedge.tasks import evaluate as evaluate_model

__all__ = ["ElasticNode", "elastic_mod"]

_NAMESPACE = "easgd"  # the node store's namespace of the node's own model


class ElasticNode:
    """A node's own model x_i, kept in ``store`` between the rounds it takes part in."""

    def __init__(self, store: NodeStore, alpha: float) -> None:
        self.store, self.alpha = store, alpha

    def own(self, center: torch.Tensor) -> torch.Tensor:
        """x_i to train this round: the model the node kept, or the center the first time."""
        own = self.store.get_tensor("local")
        return center.clone() if own is None or own.numel() != center.numel() else own

    def step(self, trained: torch.Tensor, center: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(δ_i = α(x_i − x̃) to send, the model kept x_i − δ_i, ‖x_i − x̃‖) for x_i trained to ``trained``."""
        delta, kept, distance = elastic_difference(trained, center, self.alpha)
        self.store.put_tensor("local", kept)
        return delta, kept, distance


def elastic_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    config = msg.content.config_records.get("config")
    if not msg.metadata.message_type.startswith("train") or config is None or EASGD_ALPHA not in config:
        return call_next(msg, context)
    alpha = config[EASGD_ALPHA]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and 0 < alpha <= 1):
        raise ValueError(f"{EASGD_ALPHA} must be a number in (0, 1], got {alpha!r}")
    received = msg.content.array_records.get(MODEL_RECORD)
    if received is None:
        raise LayoutError(f"an elastic train message needs the center in its {MODEL_RECORD!r} ArrayRecord")
    layout = Layout(received)
    center = torch.from_numpy(layout.flatten(received))
    node = ElasticNode(NodeStore(context.state, _NAMESPACE), float(alpha))
    content = RecordDict(dict(msg.content.items()))  # the body trains the node's own model, not the center
    content[MODEL_RECORD] = layout.rebuild(node.own(center).numpy(), received)
    msg.content = content
    update = take_update(msg, context, call_next, "take the elastic step from")
    content[MODEL_RECORD] = received  # what an outer mod takes the update against: the center
    if isinstance(update, Message):  # the body answered with an error: passed on as it is
        return update
    if isinstance(update, DeviceUpdate):  # Fedge's FedAvg handler: its update leaves through the outer mods
        return _handed_step(msg, context, update, node, center)
    delta, _, distance = node.step(torch.from_numpy(layout.flatten(update.trained)), center)
    reply = update.reply
    out = RecordDict(dict(reply.content.items()))
    out[MODEL_RECORD] = layout.rebuild((center + delta).numpy(), update.trained)
    name = next(iter(reply.content.metric_records), "metrics")
    out[name] = MetricRecord({**dict(reply.content.metric_records.get(name, MetricRecord())),
                              "center-distance": distance})
    reply.content = out
    return reply


def _handed_step(msg: Message, context: Context, update: DeviceUpdate, node: ElasticNode,
                 center: torch.Tensor) -> Message:
    """The elastic step from a Fedge handler's trained model; its ``weighted`` is off (the center
    moves by the sum of the δ_i). The node's kept model is measured here too (``local-score``, the
    coordinator never sees x_i): on the node's held-out part when the run keeps one, else on the
    task's central split when the device has it; a masked round reports nothing in clear."""
    if update.model is None:
        raise ProtocolError("this algorithm's device handler hands over no trained model to take the elastic step from")
    update.delta, kept, update.metrics["center-distance"] = node.step(local.flat_of(update.model), center)
    update.weighted = False
    if SECAGG_RECORD not in msg.content.config_records:
        config = local.round_config(msg)
        task = local.task_of(config)
        held_out = (update.parts if update.parts is not None else local.local_parts(context, config))[1]
        held_out = held_out if held_out is not None else task.test_data()
        if held_out is not None:
            own = local.load_flat(task, kept, update.model)
            update.metrics["local-score"] = float(evaluate_model(own, held_out, task)[task.primary_metric])
    return hand_off(msg, update)
