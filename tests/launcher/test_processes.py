"""free_port: the ports handed to the SuperLink and SuperNodes, chosen where no outgoing connection
can take them before their server binds them; and a process group stopping every process it owns."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from fedge.launcher import processes
from fedge.launcher.processes import ProcessGroup, free_port, processes_with_env


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # never the same port twice in one process
    ephemeral = processes._ephemeral_range()
    if ephemeral is not None and ephemeral[0] - processes._LOWEST >= 1_000:
        # the kernel places outgoing connections' local ports in the ephemeral range only
        assert all(processes._LOWEST <= p < ephemeral[0] for p in ports), (ports, ephemeral)
        # nor in Ray's default worker ports, which a Ray head refuses as its GCS port
        assert not any(10_002 <= p <= 19_999 for p in ports), ports
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_without_room_below_the_ephemeral_range_the_kernel_chooses(monkeypatch) -> None:
    monkeypatch.setattr(processes, "_ephemeral_range", lambda: (1024, 65535))
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_a_raylets_agents_are_stopped_with_its_group(tmp_path) -> None:
    """Ray 2.55 starts its dashboard and runtime-env agents in sessions of their own, with neither
    the group's marker nor FLWR_HOME, only ``RAY_RAYLET_PID``; they outlived the run (seen after a
    ``fedge demo``). A stand-in raylet starts such an agent; stopping the group stops both."""
    raylet = tmp_path / "raylet"  # the process's name is what marks a raylet
    raylet.write_text("#!/bin/sh\nenv -i RAY_RAYLET_PID=$$ setsid sleep 120 &\nsleep 120\n")
    raylet.chmod(0o755)
    group = ProcessGroup(tmp_path / "logs")
    group.start("raylet", [str(raylet)])
    deadline = time.monotonic() + 10
    while not processes_with_env("RAY_RAYLET_PID", str(group.processes[0].pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    (agent,) = processes_with_env("RAY_RAYLET_PID", str(group.processes[0].pid))
    group.stop(grace=1.0)
    deadline = time.monotonic() + 10
    while _alive(agent):
        assert time.monotonic() < deadline, f"agent {agent} outlived its group"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
