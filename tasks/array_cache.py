"""Arrays computed once per machine and read back by every later process.

Why: the embedded digits task is split by scikit-learn, whose import alone costs 1.5-2 s. A run
of ``fedge demo`` computed that split in the CLI and again in the ServerApp, on the critical path
of the start, and every later run did the same. The split is a pure function of scikit-learn's
version and the split's parameters, so it is computed once, kept as a plain ``.npz`` (no pickle),
and any process that finds it reads it with numpy alone.

A cached file is a convenience, never a source of truth: one that does not load or fails the
caller's check (shape, dtype, bounds, finiteness) is logged, recomputed and replaced, and a cache
directory that cannot be written leaves the computation as it was. Writes are atomic, so processes
that compute the same entry at once leave one whole file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedge.compression.kernel_cache import cache_dir  # one per-machine cache directory

__all__ = ["CacheEntryInvalid", "cache_dir", "cached_arrays"]

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


class CacheEntryInvalid(ValueError):
    """A cached entry that does not hold what its computation would: it is recomputed."""


def _path(directory: Path, name: str, key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return directory / f"{name}-{digest}.npz"


def _load(path: Path, check: Callable[[Arrays], None]) -> Arrays:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:  # truncated, not a zip, a pickled member
        raise CacheEntryInvalid(f"unreadable: {err}") from err
    check(arrays)
    return arrays


def _store(path: Path, arrays: Arrays) -> None:
    """A temporary file beside the entry, then a rename: a reader sees no entry or a whole one
    (tasks/ sits below deploy/, so deploy.atomic is out of reach here)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        try:
            handle.write(buffer.getvalue())
            handle.flush()
            os.fsync(handle.fileno())
        except OSError:
            Path(handle.name).unlink(missing_ok=True)
            raise
    try:
        os.replace(handle.name, path)
    except OSError:
        Path(handle.name).unlink(missing_ok=True)
        raise


def cached_arrays(name: str, key: dict[str, object], compute: Callable[[], Arrays],
                  check: Callable[[Arrays], None], *, directory: str | os.PathLike[str] | None = None,
                  redo: str = "recomputing it") -> Arrays:
    """``compute()``'s arrays, from the cache where an entry for ``key`` exists and passes
    ``check`` (which raises :class:`CacheEntryInvalid`), else computed and stored. ``directory``:
    where the entry lives (default :func:`cache_dir`; a run's own directory for what only that run
    shares); ``redo``: what the log says is done about an invalid entry."""
    path = _path(Path(directory) if directory else cache_dir(), name, key)
    if path.is_file():
        try:
            return _load(path, check)
        except CacheEntryInvalid as err:
            log.warning("cached %s at %s is invalid (%s): %s", name, path, err, redo)
    arrays = compute()
    check(arrays)  # a computation that breaks its own contract is a bug, not a cache problem
    try:
        _store(path, arrays)
    except OSError as err:  # a read-only directory: every process computes, as before the cache
        log.warning("cannot cache %s at %s: %s", name, path, err)
    return arrays
