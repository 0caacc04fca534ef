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
