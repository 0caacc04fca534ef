"""An idle device process hands its clean file pages back to the kernel (``MADV_PAGEOUT``, then
``MADV_DONTNEED`` for the pages another process keeps resident): they leave its resident set, read
back unchanged, and nothing writable, shared-memory or written before it was protected is touched."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from fedge.edge_client.page_release import _read_only_files

# A fresh interpreter (no other process maps its test file) maps 16 MiB of a file read-only, reads
# it all, releases, and reads it again.
_SCRIPT = """
import hashlib, json, mmap, os, sys, tempfile
from fedge.edge_client.page_release import release_file_pages, resident_file_bytes
path = os.path.join(sys.argv[1], "pages.bin")
with open(path, "wb") as out:
    out.write(os.urandom(16 << 20))
with open(path, "rb") as f:
    view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
digest = hashlib.sha256(view).hexdigest()  # every page read: resident
before = resident_file_bytes()
released = release_file_pages()
after = resident_file_bytes()
print(json.dumps({"before": before, "after": after, "released": released,
                  "same": hashlib.sha256(view).hexdigest() == digest}))
"""


def test_released_file_pages_leave_the_resident_set_and_read_back_unchanged(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["released"] is None:
        pytest.skip("this kernel has no MADV_PAGEOUT (Linux 5.4+)")
    assert got["before"] - got["after"] >= 14 << 20, got  # the test file's 16 MiB, near enough
    # the interpreter's own code pages it runs next fault straight back in (after the release counted)
    assert 0 <= got["released"] - (got["before"] - got["after"]) < 4 << 20, got
    assert got["same"], "a released page read back different bytes"


# The parent test process maps the same file and reads it, so its pages are mapped by two processes
# (MADV_PAGEOUT leaves them); a second mapping of it is written and then protected read-only, as a
# library's relocated RELRO data is.
_SHARED_SCRIPT = """
import ctypes, hashlib, json, mmap, os, sys
from fedge.edge_client.page_release import _read_only_files, release_file_pages, resident_file_bytes
path = sys.argv[1]
with open(path, "rb") as f:
    view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    relro = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
relro[:4] = b"mine"  # a copied-on-write page, then read-only
address = ctypes.addressof(ctypes.c_char.from_buffer(relro))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(address, len(relro), mmap.PROT_READ) == 0
digest = hashlib.sha256(view).hexdigest()
flags = {start: unmodified for start, _, unmodified in _read_only_files()}
before = resident_file_bytes()
released = release_file_pages()
print(json.dumps({"before": before, "after": resident_file_bytes(), "released": released,
                  "same": hashlib.sha256(view).hexdigest() == digest, "relro": relro[:4].decode(),
                  "relro_listed": address in flags, "relro_unmodified": flags.get(address)}))
"""


def test_pages_another_process_keeps_leave_the_resident_set_and_written_pages_stay(tmp_path) -> None:
    """Beside a ServerApp (or any process that maps torch too) ``MADV_PAGEOUT`` leaves the shared
    pages; they still leave this process's page tables. A read-only mapping that holds pages of the
    process's own keeps them: ``MADV_DONTNEED`` would have put the file's bytes back."""
    import mmap

    path = tmp_path / "shared.bin"
    path.write_bytes(os.urandom(16 << 20))
    with open(path, "rb") as f:
        mine = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        sum(mine[i] for i in range(0, len(mine), 4096))  # every page resident in this process too
        done = subprocess.run([sys.executable, "-c", _SHARED_SCRIPT, str(path)], capture_output=True, text=True,
                              timeout=120, check=True)
    finally:
        mine.close()
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["released"] is None:
        pytest.skip("this kernel has no MADV_PAGEOUT (Linux 5.4+)")
    assert got["before"] - got["after"] >= 14 << 20, got  # the shared 16 MiB left its resident set
    assert got["same"], "a released page read back different bytes"
    assert got["relro_listed"] and got["relro_unmodified"] is False, got
    assert got["relro"] == "mine", "a page the process wrote before protecting it was dropped"


def test_only_read_only_mappings_of_regular_files_are_released(tmp_path) -> None:
    """A writable private mapping may hold the process's own copied-on-write pages, a shared-memory
    file would go to swap: neither is in the list."""
    import mmap

    path = tmp_path / "data.bin"
    path.write_bytes(b"\1" * (1 << 20))
    with open(path, "r+b") as f:
        writable = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        read_only = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    writable[0] = 2  # a copied-on-write page of this process's own
    listed = {start for start, *_ in _read_only_files()}
    mine = {}  # this file's mappings: start -> permissions
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(str(path)):
            span, perms = line.split()[:2]
            mine[int(span.split("-")[0], 16)] = perms
    assert sorted(mine.values()) == ["r--s", "rw-p"]
    assert {start for start, perms in mine.items() if perms == "r--s"} <= listed
    assert not {start for start, perms in mine.items() if perms == "rw-p"} & listed
    assert not any(line.split()[5].startswith(("/dev/", "/memfd:")) for line in open("/proc/self/maps")
                   if len(line.split()) > 5 and int(line.split("-")[0], 16) in listed)
    writable.close()
    read_only.close()


def test_the_warm_parent_releases_after_each_import_unless_told_not_to(monkeypatch, caplog) -> None:
    """After each module it preloads, so the clean pages of all of them are never resident at once;
    ``FEDGE_PAGE_RELEASE=off`` keeps them."""
    from fedge.compression import kernels
    from fedge.edge_client import warm_executor
    from fedge.edge_client.warm_executor import PAGE_RELEASE_ENV, WarmExecutor, WarmNode

    calls: list[str] = []
    monkeypatch.setattr(warm_executor, "release_file_pages", lambda: calls.append("release") or 1 << 20)
    monkeypatch.setattr(kernels, "available", lambda: False)
    executor = WarmExecutor([WarmNode.parse("127.0.0.1:1")], preload=("json", "csv"))
    with caplog.at_level(logging.INFO, logger="fedge.edge.warm"):
        executor.warm_up(each=calls.append)
    assert calls == ["release", "json", "release", "csv"]
    assert "released 2 MiB of clean file pages" in caplog.text
    calls.clear()
    monkeypatch.setenv(PAGE_RELEASE_ENV, "off")
    executor.warm_up(each=calls.append)
    assert calls == ["json", "csv"]
