"""The device's layers: what every algorithm's handler gets without writing it.

The coordinator's engine wraps every algorithm in layers (``fedge.server.engine.layers``); these
are their device-side halves, so a handler (Fedge's own or a plugin's) states only its local step:

* :func:`start_model`: the model the message brings, in full or as a lattice change that
  ``compression_mod`` applied to the device's versioned copy (``edge_client.downlink``);
* :func:`upload`: the update is handed to the device's update mods, the ones a Flower app lists
  (``edge_client.device_update``): clipped to the round's bound under differential privacy
  (``dp-clip``), then masked for secure aggregation by ``secure_mod`` (a ``secagg`` record is
  present: nothing about it in clear) or encoded with the run's codec through the node's error
  feedback memory by ``compression_mod``;
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
from torch.utils.data import Dataset

from fedge.edge_client import local
from fedge.edge_client.compression_mod import compression_mod
from fedge.edge_client.device_update import DeviceUpdate, hand_off
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.secure_mod import secure_mod
from fedge.protocol import MODEL_RECORD, read_state_dict
from fedge.protocol.plugins import DEVICE_LAYERS_ATTRIBUTE
from fedge.protocol.refusals import DeviceRefusal, refusal_content
from fedge.protocol.round_config import RoundConfig
from fedge.tasks import Task, flatten_state, tensor_sizes

__all__ = ["DEVICE_LAYERS_ATTRIBUTE", "UPDATE_MODS", "refusal_mod", "start_model", "upload", "uses_device_layers"]

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])

#: the mods that send a handed-over update, outermost first: the ones a Flower app lists
#: (``ClientApp(mods=[compression_mod])``, ``[secure_mod]``), so both send it with the same code
UPDATE_MODS = (compression_mod, secure_mod)


def uses_device_layers(handler: _F) -> _F:
    """Declare that ``handler`` sends its update through :func:`upload` (so it is clipped and
    masked when the run asks): the coordinator then lets its algorithm run with secure
    aggregation and differential privacy."""
    setattr(handler, DEVICE_LAYERS_ATTRIBUTE, True)
    return handler


def start_model(msg: Message, config: RoundConfig, context: Context, task: Task,
                model: torch.nn.Module | None = None) -> torch.Tensor:
    """The flat model the message brings (in full, or as the lattice change ``compression_mod``
    already applied to the device's copy, ``edge_client.downlink``). ``model``: the handler's one
    model of this message, which it is loaded into."""
    model = task.build_model() if model is None else model
    # its floating-point tensors (what the coordinator's flat model holds); the others stay the task's
    flat = flatten_state(read_state_dict(msg.content, MODEL_RECORD, model.state_dict()))
    local.load_flat(task, flat, model)
    return flat


def upload(msg: Message, context: Context, config: RoundConfig, task: Task, update: torch.Tensor, *,
           examples: int, memory: NodeStore, generator: torch.Generator, started: float,
           metrics: dict[str, Any] | None = None, measure: torch.Tensor | None = None,
           weighted: bool = True, model: torch.nn.Module | None = None,
           parts: tuple[Dataset, Dataset | None] | None = None) -> Message:
    """The reply carrying ``update`` (a flat delta), handed to the device's update mods
    (``edge_client.device_update``): clipped under differential privacy, then masked by
    ``secure_mod`` or encoded by ``compression_mod`` through ``memory``, continuing ``generator``.

    ``metrics`` are what the handler reports in clear beside its update (loss, distances, scores);
    under secure aggregation none of them leaves the device: the reply carries ``num-examples`` 1
    and its training time, the weight travels inside the masked sum (``examples``, or 1 for an
    algorithm whose updates are not ``weighted``: EASGD's center moves by their sum). ``model``: the
    handler's one model of this message, trained: the codec takes its layout (none is built again),
    ``elastic_mod`` its parameters; ``parts``: the node's (training, held-out) data as the handler
    read it, so a mod that measures on the held-out part reads nothing again.
    """
    sizes = tensor_sizes((task.build_model() if model is None else model).state_dict())
    return hand_off(msg, DeviceUpdate(update, examples, weighted, memory.namespace, generator, started, sizes, measure,
                                      dict(metrics or {}), model=model, parts=parts))


def refusal_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A handler's typed refusal leaves as a ``refusal`` record (``fedge.protocol.refusals``)."""
    try:
        return call_next(msg, context)
    except DeviceRefusal as refusal:
        log.warning("refusing message %s: %s (%s)", msg.metadata.message_id, refusal, refusal.kind)
        return Message(refusal_content(refusal.kind, str(refusal)), reply_to=msg)
