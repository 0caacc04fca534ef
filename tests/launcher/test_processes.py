"""free_port: the ports handed to the SuperLink and SuperNodes, chosen where no outgoing connection
can take them before their server binds them."""

from __future__ import annotations

import socket

from fedge.launcher import processes
from fedge.launcher.processes import free_port


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
