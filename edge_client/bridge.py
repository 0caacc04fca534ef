"""A leaf's bridge: the root's node that stands for a whole leaf of devices.

A bridge SuperNode connects to the root's SuperLink; its ClientApp answers the root's ``train``
messages as a FedAvg device does, except that its "local training" is a step of its leaf
coordinator (``fedge.server.leaf``) from the model the message brought, asked through a
:class:`~fedge.protocol.leaf.LeafChannel`. The change of the leaf's model leaves through the
device's own upload layer: encoded with the root's codec, with the bridge's error feedback kept in
its node state (the leaf plays DoubleSqueeze's server: what one root round's message did not
carry goes up with the next), weighted by the examples behind the leaf's step, with the count of
its devices (``leaf-count``) and the devices connected to it (``leaf-connected``, what central DP's
divisor counts at the root) beside it. The root needs nothing of its own for it: its downlink
ships the bridge the model (lattice versions included), its door screens and decodes the reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from flwr.app import Context, Message, MessageType
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from fedge.deploy.atomic import atomic_write_bytes
from fedge.deploy.owned_directory import owned_directory
from fedge.edge_client import local
from fedge.edge_client.layers import UPDATE_MODS, refusal_mod, start_model, upload, uses_device_layers
from fedge.protocol import ProtocolError
from fedge.protocol.leaf import (
    DOWN_AFTER,
    HEARTBEAT,
    LEAF_CONNECTED,
    LEAF_SPOOL,
    LEAF_TIMEOUT,
    LeafChannel,
    LeafResult,
    RootOrigin,
    decode_result,
    encode_request,
    request_name,
    result_name,
)

__all__ = ["LeafTimeout", "SpoolChannel", "bridge_app", "bridge_mod", "make_bridge"]


class LeafTimeout(ProtocolError):
    """The leaf did not answer a root round within the bridge's wait: the root counts the bridge's
    reply as failed and goes on without the leaf, and the bridge withdraws its request, so that a
    leaf that comes back (restarted from its checkpoint) does not step for a root round that is over."""


class SpoolChannel:
    """The bridge's side of the leaf-local spool (``fedge.protocol.leaf``): ask by writing the
    round's request, wait for the leaf's result. A result already there (the leaf answered before
    this process restarted) is returned as it is, so a root round is answered by one leaf step.

    The wait ends early when the leaf is down: its heartbeat was fresh during this wait and then
    went ``down_after`` seconds without a beat (a leaf that is starting, its heartbeat still old
    from before, is waited for up to ``timeout``)."""

    def __init__(self, spool: str | Path, timeout: float = 3600.0, poll: float = 0.05,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 down_after: float = DOWN_AFTER, wall: Callable[[], float] = time.time) -> None:
        self.spool, self.timeout, self.poll, self.down_after = Path(spool), timeout, poll, down_after
        self.clock, self.sleep, self.wall = clock, sleep, wall
        owned_directory(self.spool)  # only this user may write it (privacy audit 3, F9)

    def step(self, root_round: int, model: torch.Tensor, origin: RootOrigin | None = None) -> LeafResult:
        result = self.spool / result_name(root_round)
        request = self.spool / request_name(root_round)
        if not result.exists() and not request.exists():
            atomic_write_bytes(request, encode_request(root_round, model, origin))
        deadline, seen_alive = self.clock() + self.timeout, False
        while not result.exists():
            silent = self._silent()
            seen_alive = seen_alive or (silent is not None and silent < self.down_after)
            down = seen_alive and silent is not None and silent >= self.down_after
            if down or self.clock() > deadline:
                request.unlink(missing_ok=True)  # withdrawn: the root's round goes on without this leaf
                why = f"it is down (no heartbeat for {silent:.0f} s)" if down else f"within {self.timeout:g} s"
                raise LeafTimeout(f"the leaf at {self.spool} did not answer round {root_round}: {why}")
            self.sleep(self.poll)
        return decode_result(result.read_bytes(), root_round, model.numel())

    def _silent(self) -> float | None:
        """Seconds since the leaf's last heartbeat (None: it has none yet)."""
        try:
            return max(0.0, self.wall() - (self.spool / HEARTBEAT).stat().st_mtime)
        except FileNotFoundError:
            return None


def make_bridge(channel: LeafChannel) -> Callable[[Message, Context], Message]:
    """The bridge's train handler over ``channel`` (its leaf)."""

    @uses_device_layers
    def train(msg: Message, context: Context) -> Message:
        started = time.perf_counter()
        config = local.round_config(msg)
        task = local.task_of(config)
        model = task.build_model()
        start = start_model(msg, config, context, task, model)
        # the root's run and this bridge's index: the leaf stamps them on its devices' messages
        origin = RootOrigin(run=int(msg.metadata.run_id), leaf=int(context.node_config.get("partition-id", 0)))
        result = channel.step(config.round, start, origin)
        if (result.count < 1 or result.weight <= 0) and not result.empty_sample:
            raise ProtocolError(f"the leaf used no device's update in its step for root round {config.round}")
        metrics = {"leaf-count": result.count, LEAF_CONNECTED: result.connected,
                   **({"train-loss": result.train_loss} if result.train_loss is not None else {})}
        return upload(msg, context, config, task, result.delta, examples=max(1, round(result.weight)),
                      memory=local.store(context, "bridge"), generator=local.node_generator(config, context, "bridge"),
                      started=started, metrics=metrics, model=model)

    return train


def bridge_app(channel: LeafChannel) -> ClientApp:
    """The bridge's ClientApp: the train handler and the typed refusals of a device's."""
    app = ClientApp(mods=[refusal_mod, *UPDATE_MODS])
    app.train()(make_bridge(channel))
    return app


def bridge_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """In Fedge's ClientApp: a node whose node config names a ``leaf-spool`` is a leaf's bridge, and
    its root's train messages are answered by its leaf (every other node passes through)."""
    spool = context.node_config.get(LEAF_SPOOL)
    if not spool or msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    timeout = float(context.node_config.get(LEAF_TIMEOUT, 3600.0))
    return make_bridge(SpoolChannel(str(spool), timeout=timeout))(msg, context)
