"""The device's layers: what every algorithm's handler gets without writing it.

The coordinator's engine wraps every algorithm in layers (``fedge.server.engine.layers``); these
are their device-side halves, so a handler (Fedge's own or a plugin's) states only its local step:

* :func:`start_model`: the model the message brings, in full or as a lattice change applied to the
  device's versioned copy (``edge_client.downlink``);
* :func:`upload`: the update leaves through one door: clipped to the round's bound under
  differential privacy (``dp-clip``), then masked for secure aggregation (a ``secagg`` record is
  present: nothing about it in clear) or encoded with the run's codec through the node's error
  feedback memory;
* :func:`refusal_mod`: a handler's :class:`~fedge.protocol.refusals.DeviceRefusal` (out of sync, a
  base it cannot rebuild, a config it cannot honour) leaves as a typed ``refusal`` record, which
  the coordinator counts and acts on by kind, instead of Flower's generic error text.

A plugin algorithm whose handler is built on these (``fedge.edge_client.algorithms.fedavg.make_train``
or its own function marked with :func:`uses_device_layers`) runs with secure aggregation and
differential privacy; one that is not is refused before its run starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from fedge.edge_client import local
from fedge.edge_client.downlink import held_support, received_model
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.secure_aggregation import masked_update
from fedge.protocol.config_keys import DP_CLIP, DP_FITTED
from fedge.protocol.plugins import DEVICE_LAYERS_ATTRIBUTE
from fedge.protocol.refusals import DeviceRefusal, refusal_content
from fedge.protocol.round_config import RoundConfig
from fedge.protocol.secagg import SECAGG_RECORD
from fedge.tasks import Task

__all__ = ["DEVICE_LAYERS_ATTRIBUTE", "refusal_mod", "start_model", "upload", "uses_device_layers"]

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def uses_device_layers(handler: _F) -> _F:
    """Declare that ``handler`` sends its update through :func:`upload` (so it is clipped and
    masked when the run asks): the coordinator then lets its algorithm run with secure
    aggregation and differential privacy."""
    setattr(handler, DEVICE_LAYERS_ATTRIBUTE, True)
    return handler


def start_model(msg: Message, config: RoundConfig, context: Context, task: Task,
                model: torch.nn.Module | None = None) -> torch.Tensor:
    """The flat model the message brings (full, or the device's lattice copy brought up to date).
    ``model``: the handler's one model of this message (a full model is loaded into it)."""
    return received_model(msg, config, local.store(context, "downlink"), task, model)


def upload(msg: Message, context: Context, config: RoundConfig, task: Task, update: torch.Tensor, *,
           examples: int, memory: NodeStore, generator: torch.Generator, started: float,
           metrics: dict[str, Any] | None = None, measure: torch.Tensor | None = None,
           weighted: bool = True, model: torch.nn.Module | None = None) -> Message:
    """The reply carrying ``update`` (a flat delta), through the device's layers.

    ``metrics`` are what the handler reports in clear beside its update (loss, distances, scores);
    under secure aggregation none of them leaves the device: the reply carries ``num-examples`` 1
    and its training time, the weight travels inside the masked sum (``examples``, or 1 for an
    algorithm whose updates are not ``weighted``: EASGD's center moves by their sum). ``model``: the
    handler's one model of this message, whose layout the codec takes (none is built again).
    """
    metrics = dict(metrics or {})
    if DP_CLIP in config.extra:  # differential privacy: this device's contribution is bounded here
        clip = config.number(DP_CLIP, low=0.0)
        norm = float(update.norm())
        metrics[DP_FITTED] = 1.0 if norm <= clip else 0.0  # adaptive clipping's bit (counted with noise)
        update = update * (clip / norm) if norm > clip > 0 else update
    seconds = {"train-seconds": metrics["train-seconds"]} if "train-seconds" in metrics else {}
    if SECAGG_RECORD in msg.content.config_records:  # secure aggregation: a masked upload, nothing in clear
        payload, _ = masked_update(msg, context, update, examples if weighted else 1, memory, generator,
                                   error_feedback=config.error_feedback)
        return local.train_reply(msg, payload, {"num-examples": 1, **seconds}, started)
    support = held_support(local.store(context, "downlink"))  # kept only under a tcs uplink
    payload, residual = local.encode(update, config, task, memory, generator, model, support=support)
    return local.train_reply(msg, payload, {"num-examples": examples, **metrics, "residual-norm": residual,
                                            "update-norm": float(update.norm())}, started, measure=measure)


def refusal_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A handler's typed refusal leaves as a ``refusal`` record (``fedge.protocol.refusals``)."""
    try:
        return call_next(msg, context)
    except DeviceRefusal as refusal:
        log.warning("refusing message %s: %s (%s)", msg.metadata.message_id, refusal, refusal.kind)
        return Message(refusal_content(refusal.kind, str(refusal)), reply_to=msg)
