"""``scaffold_mod`` and ``scaffold_correction``: SCAFFOLD on a Flower app's node, around the user's
own training loop (the server side: ``fedge.coordinator.scaffold_layer.ControlVariates``).

SCAFFOLD changes every local step, so a mod alone cannot run it: the user's loop calls the
corrector after each optimizer step,

    correct = scaffold_correction(model, lr)     # a no-op outside a SCAFFOLD round
    for x, y in loader:
        ...; optimizer.step(); correct()

and the mod does the rest: it reads the server's ``c`` from the train message, keeps ``c_i`` in
the node's ``Context`` state between rounds (``fedge.edge_client.control_variate``, as Fedge's own
SCAFFOLD devices keep it), hands the loop ``c - c_i`` through the corrector, and once the body
replied takes ``y - x`` against the model the message brought, with the step count and rate the
corrector saw, to send ``dc_i`` in the reply's ``CONTROL_RECORD``. A body that never called the
corrector gets an error reply naming it (option II needs its steps). It goes next to the body:
``ClientApp(mods=[compression_mod, scaffold_mod])``, so that ``compression_mod`` encodes the update
and its lattice downlink has rebuilt the model first. Any other message passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.aggregation.scaffold import corrected_step
from fedge.edge_client.control_variate import ControlVariate, carries_control
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.trainer import correction_pairs
from fedge.edge_client.device_update import train_user_update
from fedge.protocol.layout import Layout
from fedge.protocol.records import CONTROL_RECORD, MODEL_RECORD
from fedge.protocol.uplink_request import UplinkRequest

__all__ = ["ScaffoldUsageError", "scaffold_correction", "scaffold_mod"]

_NAMESPACE = "flower-scaffold"


class ScaffoldUsageError(RuntimeError):
    """The ClientApp's loop and the SCAFFOLD mod do not fit (no corrector called, two rates)."""


@dataclass
class _Round:
    control: ControlVariate  # this message's c and this node's c_i
    steps: int = 0
    lr: float | None = None


_ACTIVE: ContextVar[_Round | None] = ContextVar("fedge_scaffold_round", default=None)


def scaffold_correction(model: torch.nn.Module, lr: float) -> Callable[[], None]:
    """The corrector for this message's local steps: each call moves ``model``'s parameters by
    ``-lr * (c - c_i)`` (after ``optimizer.step()``) and counts the step. Outside a SCAFFOLD round it
    does nothing, so one loop serves any strategy."""
    active = _ACTIVE.get()
    if active is None:
        return lambda: None
    if active.lr is not None and active.lr != lr:
        raise ScaffoldUsageError(f"one corrector per round: asked for lr={lr} after lr={active.lr}")
    active.lr = float(lr)
    pairs = correction_pairs(model, active.control.by_parameter(model))
    if not pairs:
        raise ScaffoldUsageError("none of the model's parameters is in the message's arrays: the corrector "
                                 "needs the model whose state_dict the app sends")

    @torch.no_grad()
    def correct() -> None:
        for param, c in pairs:
            corrected_step(param, c, active.lr)  # type: ignore[arg-type]
        active.steps += 1

    return correct


def scaffold_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    if not carries_control(msg):
        return call_next(msg, context)
    received = msg.content.array_records.get(MODEL_RECORD)
    if received is None:
        return call_next(msg, context)  # train_user_update names what is missing
    layout = Layout(received)
    start = torch.from_numpy(layout.flatten(received)).to(torch.float32)
    control = ControlVariate(msg, NodeStore(context.state, _NAMESPACE), start.numel())
    active = _Round(control)
    token = _ACTIVE.set(active)
    try:
        update = train_user_update(msg, context, call_next, "take SCAFFOLD's control step from")
    finally:
        _ACTIVE.reset(token)
    if isinstance(update, Message):
        return update
    if active.steps == 0 or active.lr is None:
        raise ScaffoldUsageError("a SCAFFOLD round's training loop must call fedge.flower.scaffold_correction(model, "
                                 "lr)'s corrector after each optimizer step: no step was counted")
    config = msg.content.config_records.get("config")
    request = UplinkRequest.read(config)
    if request is not None:
        server_round, seed = request.round, request.seed
    else:  # an uncompressed app: Flower's strategies name the round in the config
        value = config.get("server-round", 0) if config is not None else 0
        server_round, seed = (value if isinstance(value, int) and not isinstance(value, bool) else 0), 0
    update.reply.content[CONTROL_RECORD] = control.reply(update.delta, active.steps, active.lr,
                                                         server_round=server_round, seed=seed)
    return update.reply
