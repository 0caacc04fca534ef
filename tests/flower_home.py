"""Stopping what ``flwr run .`` leaves behind, for the tests that run it on Flower's default local
federation (the ``flwr-default-federation`` xdist group, one test after another on one worker).

``flwr run`` starts a detached local SuperLink on fixed ports and leaves it running. The next test's
``flwr run`` reuses whatever answers on those ports: a SuperLink that was SIGKILLed a moment ago but
has not yet let go of them fails that test's run. So a test kills its run's processes and waits
until they are gone and the ports are free.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from fedge.launcher.processes import processes_with_env

#: Flower 1.42's local SuperLink: its HTTP API, its control API, and its ServerAppIo API
LOCAL_PORTS = (39091, 39093, 9091)


def _in_use(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def stop_flower_home(home: Path, timeout: float = 30.0) -> None:
    """SIGKILL every process whose environment names ``home`` as FLWR_HOME, then wait (at most
    ``timeout`` seconds) until none is left and Flower's local ports are free."""
    home = home.resolve()
    deadline = time.monotonic() + timeout
    while True:
        left = processes_with_env("FLWR_HOME", str(home))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not left and not any(_in_use(port) for port in LOCAL_PORTS):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout:g} s, processes {left} of {home} or Flower's local ports "
                                 f"{[p for p in LOCAL_PORTS if _in_use(p)]} are still there")
        time.sleep(0.2)


#: Flower 1.42's ``flwr`` gives the local SuperLink it starts a fixed 15 s
#: (``LOCAL_SUPERLINK_STARTUP_TIMEOUT``, not configurable); on 2 busy cores that start alone took
#: longer once (CI of 2026-11-29: "Failed to start local SuperLink within 15s"), and on a machine
#: half as fast the whole suite runs twice as long around it, so a run gets three starts.
SUPERLINK_LATE = "Failed to start local SuperLink within"

#: Ray gives the node that Flower's simulation starts in its own process a fixed 30 s to register its
#: raylet (``ray._private.node``, ``raylet_start_wait_time_s``, not configurable); under the whole
#: suite on this 2-core EPYC it missed that once (clean clone of 2026-12-02: "Simulation Runtime
#: crashed", and ``flwr run --stream`` still exited 0).
RAY_NODE_LATE = "The current node timed out during startup"

#: what a run that raced the machine's load prints, whatever its exit status
MACHINE_LATE = (SUPERLINK_LATE, RAY_NODE_LATE)


#: Flower's own start of its local SuperLink (``flwr.cli.local_superlink``: the same command, home
#: and log), with a deadline a loaded 2-core machine meets; ``flwr run`` then finds it up and uses
#: it. Where that module does not exist (Flower 1.41) or the environment's Python has no Flower,
#: nothing is started and ``flwr run`` starts its own, as before.
_START_LOCAL_SUPERLINK = """
try:
    from flwr.cli import local_superlink as m
except ImportError:
    raise SystemExit(0)
m.LOCAL_SUPERLINK_STARTUP_TIMEOUT = 180.0
if not m._is_local_superlink_started():
    m._start_local_superlink()
"""


def _start_local_superlink(cwd: Path, env: dict[str, str]) -> None:
    subprocess.run(["python", "-c", _START_LOCAL_SUPERLINK], cwd=cwd, env=env, capture_output=True, text=True,
                   timeout=240, check=False)  # a failure here leaves the start to ``flwr run``


def run_flwr(args: list[str], cwd: Path, env: dict[str, str], home: Path, timeout: float,
             attempts: int = 3) -> subprocess.CompletedProcess[str]:
    """Run a ``flwr`` command on Flower's default local federation of ``home``.

    Only a run whose SuperLink or Ray node missed Flower's or Ray's own fixed start deadline
    (``MACHINE_LATE``) is tried again, after that attempt's processes are stopped and the ports are
    free: that is a start racing the machine's load, not the code under test. Any other outcome,
    success or failure, is returned as it came, with its processes left to the caller's
    ``stop_flower_home``."""
    for attempt in range(1, attempts + 1):
        _start_local_superlink(cwd, env)
        done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        late = any(message in done.stdout + done.stderr for message in MACHINE_LATE)
        if not late or attempt == attempts:
            return done
        stop_flower_home(home)
    raise AssertionError("unreachable")
