"""What every algorithm's client handler shares: local data, seeds, the model start, local
training, encoding through the node's compression memory, and the reply.

Handlers (``fedge.edge_client.algorithms``: ``fedavg``, ``easgd``, ``gossip``) are thin: they read the typed round
config, decide where training starts and what to send, and call these helpers.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Context, Message
from torch.utils.data import Dataset

from fedge.compression import Codec, derive_seed, make_codec
from fedge.edge_client.node_data import holdout_split, node_data
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.trainer import LocalTrainResult, train_local
from fedge.edge_client.update_encoder import encode_update
from fedge.edge_client.device_update import train_reply
from fedge.protocol import CONFIG_RECORD, ProtocolError
from fedge.protocol.config_keys import MEMORY_STORAGE, WEIGHT_DECAY
from fedge.protocol.round_config import RoundConfig
from fedge.tasks import Task, flatten_state, make_task, tensor_sizes, unflatten_state
from fedge.tasks.device import DeviceUnavailable, resolve_device

__all__ = [
    "codec_for",
    "encode",
    "load_flat",
    "local_data",
    "local_heldout",
    "local_parts",
    "node_device",
    "node_generator",
    "round_config",
    "store",
    "task_of",
    "train",
    "train_reply",
    "weight_decay_of",
]


def round_config(msg: Message) -> RoundConfig:
    """The message's typed config (every key checked before anything trains)."""
    if CONFIG_RECORD not in msg.content.config_records:
        raise ProtocolError(f"message has no {CONFIG_RECORD!r} ConfigRecord")
    return RoundConfig.from_record(msg.content.config_records[CONFIG_RECORD])


def task_of(config: RoundConfig) -> Task:
    return make_task(config.task)


def local_parts(context: Context, config: RoundConfig) -> tuple[Dataset, Dataset | None]:
    """(training, held-out) parts of the node's data (its own file or its partition,
    ``edge_client.node_data``): with federated evaluation (``holdout`` > 0) a seeded fraction is set
    aside for the whole run, otherwise the node trains on all of it and keeps nothing (``None``)."""
    data = node_data(dict(context.node_config), task_of(config), config.partitioning)
    if config.holdout <= 0:
        return data, None
    pid = int(context.node_config.get("partition-id", context.node_id))
    return holdout_split(data, config.holdout, derive_seed(config.seed, pid, purpose="holdout"))


def local_data(context: Context, config: RoundConfig) -> Dataset:
    """The node's training data (without its held-out part when the run evaluates on devices)."""
    return local_parts(context, config)[0]


def local_heldout(context: Context, config: RoundConfig) -> Dataset | None:
    """The node's held-out part for federated evaluation; ``None`` when the run keeps none."""
    return local_parts(context, config)[1]


def node_generator(config: RoundConfig, context: Context, purpose: str) -> torch.Generator:
    """A generator for (run seed, round, partition, purpose): reproducible, different for every
    client, round and use. A device with its own data has no partition id: its node id stands in."""
    pid = int(context.node_config.get("partition-id", context.node_id))
    return torch.Generator().manual_seed(derive_seed(config.seed, config.round, pid, purpose=purpose))


def store(context: Context, namespace: str) -> NodeStore:
    return NodeStore(context.state, namespace)


def codec_for(spec: str, task: Task, model: torch.nn.Module | None = None) -> Codec:
    """The codec ``spec`` for the task's model layout (``model``: the message's one model, if built)."""
    return make_codec(spec).for_model(tensor_sizes((task.build_model() if model is None else model).state_dict()))


def load_flat(task: Task, flat: torch.Tensor, model: torch.nn.Module | None = None) -> torch.nn.Module:
    """``flat`` loaded into ``model`` (the message's one model), or into a new one."""
    model = task.build_model() if model is None else model
    model.load_state_dict(unflatten_state(flat, model.state_dict()))
    return model


def node_device(context: Context) -> torch.device:
    """Where this node trains: its node config's ``device`` (``auto``, the default: the GPU where
    CUDA is, else the CPU; ``cpu``; ``cuda``; ``cuda:N``). Asked in the message's own process (a
    warm executor's forked child), never in the parent: see ``fedge.tasks.device.resolve_device``."""
    try:
        return resolve_device(str(context.node_config.get("device", "auto")))
    except DeviceUnavailable as err:
        raise ProtocolError(f"node config: {err}") from None


def weight_decay_of(config: RoundConfig) -> float:
    """The round's SGD weight decay (``weight-decay``; absent: none), checked to be in [0, 1)."""
    if WEIGHT_DECAY not in config.extra:
        return 0.0
    value = config.number(WEIGHT_DECAY, low=0.0)
    if value >= 1.0:
        raise ProtocolError(f"config {WEIGHT_DECAY}={value} must be below 1")
    return value


def train(model: torch.nn.Module, data: Dataset, config: RoundConfig, generator: torch.Generator,
          prox_mu: float = 0.0, device: torch.device | None = None,
          correction: dict[str, torch.Tensor] | None = None) -> LocalTrainResult:
    """Local training on ``device`` (default the CPU); the model comes back to the CPU, where its
    update is taken and encoded, so nothing after training depends on where it ran. ``correction``:
    SCAFFOLD's per-parameter ``c - c_i`` (``fedge.edge_client.trainer.train_local``)."""
    elsewhere = device is not None and device.type != "cpu"
    if elsewhere:
        model.to(device)
    try:
        return train_local(model, data, task_of(config), epochs=config.local_epochs, lr=config.lr,
                           batch_size=config.batch_size, momentum=config.momentum, prox_mu=prox_mu, generator=generator,
                           correction=correction, weight_decay=weight_decay_of(config))
    finally:
        if elsewhere:
            model.to("cpu")


def encode(update: torch.Tensor, config: RoundConfig, sizes: list[int], memory: NodeStore,
           generator: torch.Generator, support: np.ndarray | None = None) -> tuple[bytes, float]:
    """The update encoded with the round's codec (for a model of tensor ``sizes``) through the
    node's persistent compression memory (``support``: what the last downlink change moved, for a
    ``tcs`` codec)."""
    storage = str(config.extra.get(MEMORY_STORAGE, "fp32"))
    return encode_update(update, make_codec(config.codec).for_model(sizes), memory, server_round=config.round,
                         seed=config.seed, error_feedback=config.error_feedback, generator=generator,
                         storage=storage, support=support)


def flat_of(model: torch.nn.Module) -> torch.Tensor:
    return flatten_state(model.state_dict())
