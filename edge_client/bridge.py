"""A leaf's bridge: the root's node that stands for a whole leaf of devices.

A bridge SuperNode connects to the root's SuperLink; its ClientApp answers the root's ``train``
messages as a FedAvg device does, except that its "local training" is a step of its leaf
coordinator (``fedge.server.leaf``) from the model the message brought, asked through a
:class:`~fedge.protocol.leaf.LeafChannel`. The change of the leaf's model leaves through the
device's own upload layer: encoded with the root's codec, with the bridge's error feedback kept in
its node state (the leaf plays DoubleSqueeze's server: what one root round's message did not
carry goes up with the next), weighted by the examples behind the leaf's step, with the count of
its devices (``leaf-count``) beside it. The root needs nothing of its own for it: its downlink
ships the bridge the model (lattice versions included), its door screens and decodes the reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedge.edge_client import local
from fedge.edge_client.layers import refusal_mod, start_model, upload, uses_device_layers
from fedge.protocol import ProtocolError
from fedge.protocol.leaf import LeafChannel

__all__ = ["bridge_app", "make_bridge"]


def make_bridge(channel: LeafChannel) -> Callable[[Message, Context], Message]:
    """The bridge's train handler over ``channel`` (its leaf)."""

    @uses_device_layers
    def train(msg: Message, context: Context) -> Message:
        started = time.perf_counter()
        config = local.round_config(msg)
        task = local.task_of(config)
        model = task.build_model()
        start = start_model(msg, config, context, task, model)
        result = channel.step(config.round, start)
        if result.count < 1 or result.weight <= 0:
            raise ProtocolError(f"the leaf used no device's update in its step for root round {config.round}")
        metrics = {"leaf-count": result.count, **({"train-loss": result.train_loss}
                                                   if result.train_loss is not None else {})}
        return upload(msg, context, config, task, result.delta, examples=max(1, round(result.weight)),
                      memory=local.store(context, "bridge"), generator=local.node_generator(config, context, "bridge"),
                      started=started, metrics=metrics, model=model)

    return train


def bridge_app(channel: LeafChannel) -> ClientApp:
    """The bridge's ClientApp: the train handler and the typed refusals of a device's."""
    app = ClientApp(mods=[refusal_mod])
    app.train()(make_bridge(channel))
    return app
