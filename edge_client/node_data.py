"""Where a node's training data comes from, loaded fast in Flower's fresh process per message.

Two sources, chosen by the node config (``flower-supernode --node-config ...``):

* ``data="/path/own.npz"``: the device's **own data** (``fedge-edge join --data``), in the format of
  ``fedge.tasks.data_files`` (arrays ``x`` and ``y``), checked in full before anything trains.
* otherwise ``partition-id`` / ``num-partitions``: that partition of the task's bundled pool under
  the run's partitioning (``tasks.partition``, flwr-datasets partitioners). With ``cache-dir=DIR``
  the partition is computed once and stored as such an ``.npz`` (atomic write); every later message
  reads ~10 KB instead of importing scikit-learn and ``datasets`` and re-partitioning (1.5-4 s per
  message on the deployment engine, which starts a process per message).
"""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from fedge.tasks import Task, TensorData
from fedge.deploy.atomic import atomic_write_bytes
from fedge.tasks.base import as_tensor_data
from fedge.tasks.data_files import DataFileError, load_npz

__all__ = ["DataFileError", "holdout_split", "load_npz", "node_data", "save_npz"]

log = logging.getLogger(__name__)

_FORMAT_VERSION = 1


def save_npz(path: str | Path, data: Dataset) -> None:
    """Write a dataset in the format :func:`load_npz` reads (atomically: never a half-written file)."""
    tensors = as_tensor_data(data)
    y = tensors.y.numpy()
    buffer = io.BytesIO()
    np.savez(buffer, x=tensors.x.numpy().astype(np.float32),
             y=y.astype(np.int64) if y.dtype.kind in "iu" else y.astype(np.float32))
    atomic_write_bytes(path, buffer.getvalue(), mode=0o644)


def holdout_split(data: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """``(train, held_out)``: a seeded ``fraction`` of a node's data set aside for federated
    evaluation, the same at every message of the run (the seed is the run's and the node's, never
    the round's), at least one sample on each side when the node has two or more."""
    import torch

    from fedge.tasks.base import subset

    count = len(data)  # type: ignore[arg-type]
    if fraction <= 0 or count < 2:
        return data, data
    held = min(count - 1, max(1, round(fraction * count)))
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    return subset(data, sorted(order[held:])), subset(data, sorted(order[:held]))


def node_data(node_config: dict, task: Task, partitioning: str) -> Dataset:
    """This node's data (see the module docstring for the sources and their order)."""
    own = node_config.get("data")
    if own:
        return load_npz(str(own), task)
    try:
        pid, count = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except KeyError as err:
        raise ValueError(
            f"node config lacks {err}: start the SuperNode with --node-config "
            "'partition-id=I num-partitions=N', or give the device its own data with data=PATH.npz"
        ) from None
    cache_dir = node_config.get("cache-dir")
    if not cache_dir:
        return task.partition(pid, count, partitioning)
    key = hashlib.sha256(f"{_FORMAT_VERSION}|{task.spec}|{partitioning}|{pid}|{count}".encode()).hexdigest()
    path = Path(str(cache_dir)) / f"partition-{pid}-of-{count}-{key[:16]}.npz"
    if path.exists():
        try:
            return load_npz(path, task)
        except DataFileError as err:
            log.warning("cached partition unusable, rebuilding it: %s", err)
    data = task.partition(pid, count, partitioning)
    if isinstance(data, TensorData):  # a task's own Dataset may be lazy or large: cache tensors only
        save_npz(path, data)
    return data
