"""Hand an idle device process's clean file pages back to the kernel, as Android compacts a cached app.

A warm device process (``fedge.edge_client.warm_executor``) imports torch, Flower and Fedge once
and then waits for messages. A third of what it holds resident after its imports (93 of 274 MiB on
torch 2.13 and Flower 1.42, ``bench/clientapp_cpu.py``) is clean file-backed pages: the shared
libraries' code and read-only data, touched once by their static initialisers and by the imports,
and not again by a process that only forks. ``MADV_PAGEOUT`` (Linux 5.4) reclaims them now instead
of whenever the device runs short; Android's activity manager does the same to its cached apps
("file compaction"). Nothing is lost: a page a message's child needs later faults back in from the
page cache, or once from storage. Anonymous memory (Python's objects, torch's operator tables) is
left alone: without swap it cannot be reclaimed, and with zram every message would pay to
decompress it.

Only read-only mappings of regular files are released: a writable private mapping may hold the
process's own copied-on-write pages, and a shared-memory file would be written to swap.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys

__all__ = ["MADV_PAGEOUT", "release_file_pages", "resident_file_bytes"]

log = logging.getLogger(__name__)

#: ``madvise`` advice (Linux 5.4+, ``include/uapi/asm-generic/mman-common.h``)
MADV_PAGEOUT = 21


def resident_file_bytes() -> int:
    """This process's resident file-backed memory (``RssFile`` of ``/proc/self/status``), or 0."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _read_only_files() -> list[tuple[int, int]]:
    """(start, length) of every read-only mapping of a regular file in ``/proc/self/maps``."""
    spans: list[tuple[int, int]] = []
    regular: dict[str, bool] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or "w" in fields[1]:
                continue
            path = fields[5].strip()
            if not path.startswith("/") or path.endswith("(deleted)") or path.startswith(("/dev/", "/memfd:")):
                continue
            if path not in regular:
                regular[path] = os.path.isfile(path)
            if regular[path]:
                start, end = (int(address, 16) for address in fields[0].split("-"))
                spans.append((start, end - start))
    return spans


def release_file_pages() -> int | None:
    """Page out this process's clean, read-only file mappings; the bytes of resident file memory
    that went, or None where the kernel cannot (not Linux, a kernel before 5.4, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    before = resident_file_bytes()
    try:
        spans = _read_only_files()
    except OSError:
        return None
    for start, length in spans:
        if madvise(start, length, MADV_PAGEOUT) != 0:
            code = ctypes.get_errno()
            if code == errno.EINVAL:  # the kernel does not know the advice (before 5.4)
                log.info("no MADV_PAGEOUT on this kernel: the process keeps its file pages resident")
                return None
            # a mapping that went away meanwhile (ENOMEM) or is locked (EAGAIN): leave it
    return max(0, before - resident_file_bytes())
