"""Atomic file writes: a crash leaves either the old file or the new one, never half of either.

Write to a temporary file in the same directory, flush and fsync it, ``os.replace`` it over the
target (atomic on POSIX within one file system), then fsync the directory so the rename itself is
durable. Used for checkpoints, final models and (later) bundles.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_torch_save", "atomic_write_bytes", "atomic_write_text"]


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically. The file is private (0600) unless ``mode`` is given."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(target.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_torch_save(path: str | os.PathLike[str], obj: Any) -> None:
    """``torch.save`` through :func:`atomic_write_bytes` (the object is serialised in memory first)."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
