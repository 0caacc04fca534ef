"""A data file of one's own: a device's training data, or the coordinator's held-out data.

Format: a NumPy ``.npz`` archive (no pickles) with exactly two arrays,

- ``x``: floating point (float32, or float16/float64 converted to float32), shape
  ``(N, *task.input_shape)`` (digits: ``(N, 1, 8, 8)`` with values in [0, 1]), every value finite;
- ``y``: the targets. A classification task: integer labels of shape ``(N,)``, each in
  ``0 .. task.num_classes - 1``. Any other task: floats of shape ``(N, *task.target_shape)``
  (``(N,)`` for a scalar regression target), every value finite;

with N ≥ 1. :func:`load_npz` checks all of it and raises :class:`DataFileError` naming the problem
(``fedge-edge join`` runs it before anything connects, the coordinator before the first round).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch

from fedge.tasks.base import Task, TensorData

__all__ = ["DataFileError", "load_npz", "validate_arrays"]


class DataFileError(ValueError):
    """A data file is missing, unreadable or does not fit the task."""


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
    if task.is_classification and y.dtype.kind not in "iu":
        raise DataFileError(f"{where}: y must hold integer labels, got dtype {y.dtype}")
    if not task.is_classification and y.dtype.kind not in "fiu":
        raise DataFileError(f"{where}: y must hold numbers, got dtype {y.dtype}")
    expected = tuple(task.input_shape)
    if x.ndim != 1 + len(expected) or tuple(x.shape[1:]) != expected:
        raise DataFileError(
            f"{where}: x has shape {tuple(x.shape)}; task {task.spec!r} needs (N, {', '.join(map(str, expected))})"
        )
    if y.ndim == 0 or x.shape[0] != y.shape[0]:
        raise DataFileError(f"{where}: {x.shape[0]} samples in x but y has shape {tuple(y.shape)}")
    if x.shape[0] == 0:
        raise DataFileError(f"{where}: no samples")
    if not np.isfinite(x).all():
        raise DataFileError(f"{where}: x holds {int((~np.isfinite(x)).sum())} NaN or infinite values")
    targets = (torch.from_numpy(y.astype(np.int64)) if task.is_classification
               else torch.from_numpy(np.ascontiguousarray(y, dtype=np.float32)))
    try:
        task.check_targets(targets, where)
    except ValueError as err:
        raise DataFileError(str(err)) from None
    return TensorData(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), targets)
