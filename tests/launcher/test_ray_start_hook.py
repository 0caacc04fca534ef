"""A run's own Ray head leaves out the Ray Client server and the autoscaler's monitor
(``fedge.launcher.ray_start_hook``), through the hook ``ray start`` itself calls."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from ray._private.parameter import RayParams

from fedge.launcher.processes import ProcessGroup, free_port
from fedge.launcher.ray_start_hook import lean_head


def test_the_hook_leaves_the_client_server_and_the_monitor_out_of_a_head_only() -> None:
    head, worker = RayParams(ray_client_server_port=10001), RayParams(ray_client_server_port=10001)
    lean_head(head, True)
    lean_head(worker, False)
    assert head.ray_client_server_port is None and head.no_monitor
    assert worker.ray_client_server_port == 10001 and not worker.no_monitor


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # it exited meanwhile
        return ""


@pytest.mark.integration
def test_a_runs_ray_head_starts_without_a_client_server_or_a_monitor(tmp_path) -> None:
    """The head as ``fedge demo`` starts it: Ray's own session shows which processes it started
    (a log per process), and neither is among them; the ones Flower needs are."""
    from fedge.server.local import _start_ray_head

    with ProcessGroup(tmp_path / "logs") as group:
        temp_dir = _start_ray_head(group, f"127.0.0.1:{free_port()}", 1, tmp_path)
        try:
            deadline = time.monotonic() + 120
            log = tmp_path / "logs" / "ray-head.log"
            while "Ray runtime started" not in (log.read_text() if log.exists() else ""):
                assert time.monotonic() < deadline, log.read_text() if log.exists() else "no ray-head.log"
                time.sleep(0.2)
            started = {p.name.split(".")[0] for p in (temp_dir / "session_latest" / "logs").iterdir()}
            assert {"gcs_server", "raylet", "dashboard_agent", "runtime_env_agent"} <= started, started
            assert "ray_client_server" not in started, started
            running = [_command_line(pid) for pid in group.stragglers()]
        finally:
            group.stop(grace=0.3, finished=True)  # as a finished run stops it
            shutil.rmtree(temp_dir, ignore_errors=True)
    assert any("raylet" in cmd for cmd in running), running  # the sweep saw the head's processes
    assert not any("autoscaler/_private/monitor.py" in cmd for cmd in running), running
