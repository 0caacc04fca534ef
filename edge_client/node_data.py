"""Where a node's training data comes from, loaded fast in Flower's fresh process per message.

Two sources, chosen by the node config (``flower-supernode --node-config ...``):

* ``data="/path/own.npz"``: the device's **own data** (``fedge-edge join --data``). Format: a NumPy
  ``.npz`` archive (no pickles) with exactly two arrays,

  - ``x``: floating point (float32, or float16/float64 converted to float32), shape
    ``(N, *task.input_shape)`` (digits: ``(N, 1, 8, 8)`` with values in [0, 1]), every value finite;
  - ``y``: integer labels, shape ``(N,)``, each in ``0 .. task.num_classes - 1``;

  with N ≥ 1. :func:`load_npz` checks all of it and raises :class:`DataFileError` naming the problem
  (``fedge-edge join`` runs it before anything connects).
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
import zipfile
from pathlib import Path

import numpy as np
import torch

from fedge.deploy.atomic import atomic_write_bytes
from fedge.tasks import Task, TensorData

__all__ = ["DataFileError", "load_npz", "node_data", "save_npz"]

log = logging.getLogger(__name__)

_FORMAT_VERSION = 1


class DataFileError(ValueError):
    """A node's data file is missing, unreadable or does not fit the task."""


def load_npz(path: str | Path, task: Task) -> TensorData:
    """The samples of ``path`` after checking every property the module docstring lists."""
    source = Path(path)
    try:
        with np.load(source, allow_pickle=False) as archive:
            names = sorted(archive.files)
            if names != ["x", "y"]:
                raise DataFileError(f"{source}: expected exactly the arrays 'x' and 'y', found {names}")
            x, y = archive["x"], archive["y"]
    except DataFileError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise DataFileError(f"{source}: not a readable .npz archive without pickles ({err})") from None
    return validate_arrays(x, y, task, str(source))


def validate_arrays(x: np.ndarray, y: np.ndarray, task: Task, where: str = "data") -> TensorData:
    if x.dtype.kind != "f":
        raise DataFileError(f"{where}: x must hold floats (float32), got dtype {x.dtype}")
    if y.dtype.kind not in "iu":
        raise DataFileError(f"{where}: y must hold integer labels, got dtype {y.dtype}")
    expected = tuple(task.input_shape)
    if x.ndim != 1 + len(expected) or tuple(x.shape[1:]) != expected:
        raise DataFileError(
            f"{where}: x has shape {tuple(x.shape)}; task {task.spec!r} needs (N, {', '.join(map(str, expected))})"
        )
    if y.ndim != 1:
        raise DataFileError(f"{where}: y must be one label per sample, shape (N,), got {tuple(y.shape)}")
    if x.shape[0] != y.shape[0]:
        raise DataFileError(f"{where}: {x.shape[0]} samples in x but {y.shape[0]} labels in y")
    if x.shape[0] == 0:
        raise DataFileError(f"{where}: no samples")
    if not np.isfinite(x).all():
        raise DataFileError(f"{where}: x holds {int((~np.isfinite(x)).sum())} NaN or infinite values")
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= task.num_classes:
        raise DataFileError(
            f"{where}: labels must be in 0..{task.num_classes - 1} for task {task.spec!r}, found {low}..{high}"
        )
    return TensorData(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
                      torch.from_numpy(y.astype(np.int64)))


def save_npz(path: str | Path, data: TensorData) -> None:
    """Write ``data`` in the format :func:`load_npz` reads (atomically: never a half-written file)."""
    buffer = io.BytesIO()
    np.savez(buffer, x=data.x.numpy().astype(np.float32), y=data.y.numpy().astype(np.int64))
    atomic_write_bytes(path, buffer.getvalue(), mode=0o644)


def node_data(node_config: dict, task: Task, partitioning: str) -> TensorData:
    """This node's training data (see the module docstring for the sources and their order)."""
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
    save_npz(path, data)
    return data
