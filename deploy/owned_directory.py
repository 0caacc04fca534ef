"""A directory that only its owner may write: the leaf spool, where a leaf and its bridge hand each
other models and sums.

Whoever can write into the spool can hand a bridge a forged leaf result, or a leaf a forged root
model; an existing directory was used whatever its owner and mode (privacy audit 3, F9). Now it is
made ``0700``, and an existing one is refused when another user owns it or its group or others may
write to it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["UnsafeDirectoryError", "owned_directory"]


class UnsafeDirectoryError(OSError):
    """The directory is another user's, or others may write to it."""


def owned_directory(path: str | os.PathLike[str]) -> Path:
    """``path``, created ``0700`` if missing; raises :class:`UnsafeDirectoryError` when it exists and
    is not this user's, or is writable by its group or by others."""
    directory = Path(path)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectoryError(f"{directory} is not a directory")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise UnsafeDirectoryError(f"{directory} belongs to user {info.st_uid}, not to this one ({os.getuid()}): "
                                   "whoever owns it could hand this process forged models")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectoryError(f"{directory} is writable by its group or by others (mode "
                                   f"{stat.S_IMODE(info.st_mode):o}): chmod go-w it, or use another directory")
    return directory
