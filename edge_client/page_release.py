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

``MADV_PAGEOUT`` skips a page that another process maps too: beside a ServerApp or any other torch
process on the same machine, most of torch's pages stayed in the warm process's resident set (275
MiB RSS in ``bench/clientapp_cpu.py``'s run, against 213 MiB alone). So a mapping that holds only
the file's own pages (``Anonymous`` and ``Swap`` both 0 in ``/proc/self/smaps``) is then dropped from
this process's page tables with ``MADV_DONTNEED``: the page cache keeps the pages for whoever else
maps them, and an access here faults them back unchanged. A child of a fork pays nothing for it:
``fork`` copies no page table entries of a file mapping without anonymous pages, so a child faults in
the code it runs either way.

Only read-only mappings of regular files are released: a writable private mapping may hold the
process's own copied-on-write pages, and a shared-memory file would be written to swap. A read-only
mapping that was written before it was protected (a library's relocated ``RELRO`` data) holds
anonymous pages: ``MADV_DONTNEED`` would put the file's bytes back under them, so it gets
``MADV_PAGEOUT`` only.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys

__all__ = ["MADV_DONTNEED", "MADV_PAGEOUT", "release_file_pages", "resident_file_bytes"]

log = logging.getLogger(__name__)

#: ``madvise`` advice (``include/uapi/asm-generic/mman-common.h``; ``MADV_PAGEOUT`` since Linux 5.4)
MADV_DONTNEED = 4
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


def _read_only_files() -> list[tuple[int, int, bool]]:
    """(start, length, unmodified) of every read-only mapping of a regular file in
    ``/proc/self/smaps``; ``unmodified``: it holds none of this process's own pages (no anonymous
    page resident or swapped) and is not locked, so dropping its pages loses nothing."""
    spans: list[tuple[int, int, bool]] = []
    regular: dict[str, bool] = {}
    current: list[int] | None = None  # [start, length, anonymous kB + swap kB + locked kB] of a listed mapping
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):  # a mapping's first line: range perms offset dev inode path
                current = None
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
                    current = [start, end - start, 0]
                    spans.append(current)  # type: ignore[arg-type]
            elif current is not None and head in ("Anonymous:", "Swap:", "Locked:"):
                current[2] += int(rest.split()[0])
    return [(start, length, own == 0) for start, length, own in spans]  # type: ignore[misc]


def release_file_pages() -> int | None:
    """Page out this process's clean, read-only file mappings and drop from its page tables those
    other processes keep resident; the bytes of resident file memory that went, or None where the
    kernel cannot (not Linux, a kernel before 5.4, no libc)."""
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
    for start, length, _ in spans:
        if madvise(start, length, MADV_PAGEOUT) != 0:
            code = ctypes.get_errno()
            if code == errno.EINVAL:  # the kernel does not know the advice (before 5.4)
                log.info("no MADV_PAGEOUT on this kernel: the process keeps its file pages resident")
                return None
            # a mapping that went away meanwhile (ENOMEM) or is locked (EAGAIN): leave it
    for start, length, unmodified in spans:  # what PAGEOUT left because another process maps it too
        if unmodified:
            madvise(start, length, MADV_DONTNEED)  # a mapping gone meanwhile (ENOMEM): nothing to drop
    return max(0, before - resident_file_bytes())
