"""Where numba keeps the compiled kernels: one cache per *content* of their source, wherever it lies.

Why: numba's own locators key a cache by the source file's directory (its ``__pycache__``, or a
per-directory folder under ``NUMBA_CACHE_DIR``). A Flower app bundle carries fedge's code, and
Flower installs it afresh under every run's ``FLWR_HOME/apps/<bundle>``, so every run started with
an empty cache: each simulation actor and the ServerApp compiled every kernel it used again, on the
critical path of round 1 (about 0.5 CPU-s per kernel set per process on this machine, seen with
py-spy in ``fedge demo``). Here the cache lies under the per-machine cache directory, in a folder
named by the SHA-256 of ``jit.py``: every copy of the same code, in a checkout, a wheel or a bundle,
reads and writes one cache, and changed code gets a new folder. numba still checks each entry's
source stamp (the file's hash), signature and CPU target before it loads one, and writes entries
atomically (a temporary file, then a rename), so processes that compile at once leave whole files.

:func:`install` puts the locator first in numba's list (the ``NUMBA_CACHE_LOCATOR_CLASSES``
setting, numba >= 0.62) and leaves numba's defaults behind it for every other function. It
changes nothing where the user chose a locator list or ``NUMBA_CACHE_DIR``, or where numba has no
such setting; a cache folder that cannot be written falls through to numba's own locators.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

__all__ = ["cache_dir", "install", "kernel_cache_path"]

#: the module whose kernels this locator serves (its functions carry this ``__module__``)
KERNEL_MODULE = "fedge.compression.jit"
#: numba's own locators, in numba's order, after ours
_NUMBA_DEFAULTS = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator",
                   "IPythonCacheLocator", "ZipCacheLocator")


def cache_dir() -> Path:
    """``$FEDGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedge``, else ``~/.cache/fedge``."""
    if os.environ.get("FEDGE_CACHE_DIR"):
        return Path(os.environ["FEDGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedge"


@functools.lru_cache(maxsize=8)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:20]


def kernel_cache_path(source: str | Path) -> Path:
    """The folder that holds the compiled kernels of this ``jit.py`` (named by its content)."""
    st = os.stat(source)
    return cache_dir() / "numba" / _digest(str(source), st.st_mtime_ns, st.st_size)


def install() -> bool:
    """Put :class:`ContentKeyedLocator` first in numba's locator list; whether it is in use.
    Call before the kernels are decorated: numba picks a function's locator when it enables caching."""
    import numba

    config = numba.config
    if not hasattr(config, "CACHE_LOCATOR_CLASSES") or getattr(config, "CACHE_DIR", ""):
        return False
    ours = f"{__name__}.ContentKeyedLocator"
    current = config.CACHE_LOCATOR_CLASSES or ""
    if current and not current.startswith(ours):
        return False  # the user's own list wins
    config.CACHE_LOCATOR_CLASSES = ",".join((ours, *_NUMBA_DEFAULTS))
    return True


@functools.cache
def _locator_class() -> type:
    """Built on first use, so that reading :func:`cache_dir` (the task cache does) never imports numba."""
    from numba.core.caching import InTreeCacheLocator

    class ContentKeyedLocator(InTreeCacheLocator):  # type: ignore[misc]
        """numba's in-tree locator with the folder moved to :func:`kernel_cache_path`, for the kernels only."""

        def __init__(self, py_func, py_file):  # type: ignore[no-untyped-def]
            super().__init__(py_func, py_file)
            self._cache_path = str(kernel_cache_path(py_file))

        @classmethod
        def from_function(cls, py_func, py_file):  # type: ignore[no-untyped-def]
            if getattr(py_func, "__module__", None) != KERNEL_MODULE:
                return None  # every other function: numba's own locators, as before
            return super().from_function(py_func, py_file)  # None if the folder cannot be written

    ContentKeyedLocator.__module__ = __name__
    return ContentKeyedLocator


def __getattr__(name: str) -> type:  # numba imports ``<this module>.ContentKeyedLocator`` by name
    if name == "ContentKeyedLocator":
        return _locator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
