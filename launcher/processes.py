"""Lifetimes of the real processes Fedge starts (SuperLink, SuperNodes, ``flwr run``).

Every process is started in its own session (so a signal reaches its whole process group) with its
output in a log file, and with a marker variable ``FEDGE_PROCESS_GROUP=<uuid>`` in its environment
that every descendant inherits (Flower's SuperExec, ServerApp/ClientApp subprocesses, Ray's daemons
and workers, even those that detach into their own session or get re-parented to init).
:meth:`ProcessGroup.stop` sends SIGTERM to every process carrying the marker (found through
``/proc``, Linux) and SIGKILL to whatever outlives a grace period.
Used as a context manager it stops everything on normal exit, on error and on Ctrl-C alike; the CLI
turns SIGTERM into the same path.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import sys
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "module_argv",
    "MARKER",
    "ManagedProcess",
    "ProcessGroup",
    "free_port",
    "processes_with_env",
    "wait_for_port",
]

log = logging.getLogger(__name__)

#: Environment variable that tags every process a ProcessGroup starts, and their descendants.
MARKER = "FEDGE_PROCESS_GROUP"


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


#: ports this process has handed out, never handed out twice
_HANDED_OUT: set[int] = set()
#: where free_port looks when the system's ephemeral range leaves room below it: above Ray's
#: default worker ports (10002-19999), which a Ray node takes for its workers and refuses as its own
#: GCS port ("worker_ports is trying to use a port number ... used by other components")
_LOWEST = 20_000


def module_argv(module: str) -> list[str]:
    """``python -m module`` without the working directory on ``sys.path``.

    ``python -m`` puts its working directory first on the import path, so a file planted there (a
    ``json.py`` beside a node key whose directory the flwr helper ran in) ran as the operator (privacy
    audit 3, F4). ``-I`` would also drop ``PYTHONPATH``, which a checkout run without installing
    needs; here the first entry, the working directory, is removed before anything is imported
    (``sys`` is built in), then ``runpy`` runs the module as ``-m`` would."""
    return [sys.executable, "-c", "import sys; del sys.path[0]; import runpy; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"]


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for a process to bind later.

    Why not simply the port the kernel gives ``bind(0)``: that is an ephemeral port, from the range
    the kernel also draws the local end of every outgoing connection from. Between this call and the
    server binding it, another process's outgoing connection can take it. With 17 processes of a
    local cluster dialing each other, a SuperNode's runtime API then failed to start ("address
    already in use", 2026-11-26). So where the system's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``) leaves room below it, the port comes from there,
    at random, where no outgoing connection is placed. It is never one this process handed out
    before.
    """
    ephemeral = _ephemeral_range()
    if ephemeral is not None and ephemeral[0] - _LOWEST >= 1_000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(_LOWEST, ephemeral[0])
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError("no free TCP port on 127.0.0.1")


def wait_for_port(port: int, timeout: float, process: ManagedProcess | None = None, host: str = "127.0.0.1") -> None:
    """Block until ``host``:``port`` accepts connections; fail early if ``process`` dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            raise RuntimeError(
                f"{process.name} exited with code {process.popen.returncode} before listening on "
                f"port {port}; log {process.log_path}:\n{process.log_tail()}"
            )
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listened on {host}:{port} within {timeout:.0f} s")


def processes_with_env(key: str, value: str, *, under: bool = False) -> list[int]:
    """Live (non-zombie) PIDs whose environment contains ``key=value``; with ``under``, also
    ``key=value/...`` (a run's FLWR_HOME and the SuperNode homes inside it)."""
    needle = f"{key}={value}".encode()
    prefix = needle.rstrip(b"/") + b"/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        entries = environ.split(b"\0")
        if (needle in entries or (under and any(e.startswith(prefix) for e in entries))) and _exists(int(entry.name)):
            found.append(int(entry.name))
    return found


class ProcessGroup:
    """Start processes with logs under ``log_dir``; stop all of them (and their trees) reliably."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        also_match: Mapping[str, str] | None = None,
    ) -> None:
        """``also_match``: further ``KEY=value`` environment entries that mark a process as ours.

        The engines pass the run's unique FLWR_HOME: Ray's dashboard and runtime-env agents were
        seen (2 in ~20 runs) outliving the marker sweeps while carrying the run's FLWR_HOME. Ray
        2.55 starts them with neither the marker nor FLWR_HOME, only ``RAY_RAYLET_PID``: every
        raylet seen among the group's processes is remembered, and its agents count as the group's.
        """
        self.also_match = dict(also_match or {})
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env if env is not None else os.environ)
        self.marker = uuid.uuid4().hex
        self.env[MARKER] = self.marker
        self.processes: list[ManagedProcess] = []
        self._raylets: set[int] = set()  # raylets of this group: their agents are ours too

    def start(self, name: str, argv: Sequence[str], cwd: str | os.PathLike[str] | None = None,
              env: Mapping[str, str] | None = None) -> ManagedProcess:
        """``env``: entries that differ for this process only (a SuperNode's own FLWR_HOME); the
        group's marker always stays."""
        log_path = self.log_dir / f"{name}.log"
        handle = open(log_path, "ab")  # noqa: SIM115 - owned by the child after Popen
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {}), MARKER: self.marker},
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            handle.close()
        process = ManagedProcess(name, popen, log_path)
        self.processes.append(process)
        log.debug("started %s (pid %d): %s", name, popen.pid, " ".join(argv))
        return process

    def stop(self, grace: float = 10.0, *, finished: bool = False) -> None:
        """SIGTERM every process of the group, SIGKILL whatever outlives ``grace`` seconds.

        ``finished``: the work is done and its results are on disk, so what is left is teardown
        (Flower's simulation shutting Ray down took 3-6 s after SIGTERM): a short ``grace`` is the
        caller's choice, and killing what outlives it is expected, not a warning.

        Only processes that still carry this group's marker are signalled, so a PID that was reused
        by an unrelated process after ours exited is never touched. SIGINT/SIGTERM are blocked while
        this runs: a second Ctrl-C cannot abandon the cleanup half-way.
        """
        blocked = {signal.SIGINT, signal.SIGTERM}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            early = self.stragglers()  # before any signal: the raylets whose agents are ours too
            for process in reversed(self.processes):
                if process.alive():
                    _signal_group(process.pid, signal.SIGTERM)
            for pid in sorted(set(early) | set(self.stragglers())):
                _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and (
                self.stragglers() or any(p.alive() for p in self.processes)
            ):
                for process in self.processes:
                    process.popen.poll()  # reap our direct children so they stop counting
                time.sleep(0.1)
            left = self.stragglers()
            if left:
                (log.debug if finished else log.warning)("processes %s ignored SIGTERM for %.1f s; killing them",
                                                          left, grace)
            # Kill until the group stays empty: a dying supervisor (Ray's raylet) may still spawn a
            # child between two sweeps; it carries the marker (a forked child is in /proc at once)
            # and is caught by the next one. 2 s of quiet after a real kill mid-run; otherwise two
            # empty sweeps (0.2 s; it was 0.5 s, a third of a finished demo's teardown).
            quiet_needed = 2.0 if left and not finished else 0.2
            quiet_since, deadline = None, time.monotonic() + 10.0
            while time.monotonic() < deadline:
                self.kill_all()
                for process in self.processes:
                    process.popen.poll()
                if self.stragglers():
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > quiet_needed:
                    break
                time.sleep(0.1)
            for process in self.processes:
                try:
                    process.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    log.error("%s (pid %d) is still running after SIGKILL", process.name, process.pid)
            left = self.stragglers()
            if left:
                log.error("processes of this group survived SIGKILL: %s", left)
            self.processes.clear()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def kill_all(self) -> None:
        """SIGKILL every process of the group at once, without grace: a simulated power cut."""
        for pid in self.stragglers():
            _signal(pid, signal.SIGKILL)

    def stragglers(self) -> list[int]:
        """Live processes that carry this group's marker (or one of the ``also_match`` entries),
        never this process or its ancestors (a shell that exported the same FLWR_HOME)."""
        found = set(processes_with_env(MARKER, self.marker))
        for key, value in self.also_match.items():
            found.update(processes_with_env(key, value))
        self._raylets.update(pid for pid in found if _command_name(pid) == "raylet")
        for raylet in self._raylets:
            found.update(processes_with_env("RAY_RAYLET_PID", str(raylet)))
        return sorted(found - _ancestors())

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ancestors() -> set[int]:
    """PIDs of this process and its ancestors (from /proc/<pid>/stat's parent field)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited already; it only waits for its parent to reap it
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        _signal(pid, sig)
