"""What a run's own Ray head leaves out: ``ray start`` calls ``RAY_START_HOOK`` with its parameters
before it starts a node (``ray/scripts/scripts.py``), and Fedge's launcher names :func:`lean_head`.

A simulation's Ray head serves one run on one machine, for Flower's Simulation Engine, which joins
it as a driver through ``RAY_ADDRESS``. Two of the processes ``ray start --head`` adds serve
nothing there, and both start on the run's critical path, when the SuperLink, the ServerApp and
Ray's own processes share the machine's cores:

- the Ray Client server (``ray://``, for drivers on other machines): 0.76-0.96 CPU-s to start on a
  2-core Xeon. It listens on port 10001 whenever grpcio is installed, so two runs at once on one
  machine contend for that port. ``ray start`` accepts no option that leaves it out (it refuses port
  0); its parameters do (``ray_client_server_port=None``, what ``ray.init`` uses);
- the autoscaler's monitor: a run's head has a fixed size and no node to add (``--no-monitor``).

Nothing Flower or Fedge uses is lost: the GCS, the raylet, the dashboard's API server and Ray's
agents start as before. A head on a Ray cluster the user runs (``--ray-address``) is theirs and is
never touched. This module imports nothing: ``ray start`` loads it before the head starts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HOOK", "lean_head"]

#: the value of ``RAY_START_HOOK`` for the run's own head
HOOK = "fedge.launcher.ray_start_hook.lean_head"


def lean_head(params: Any, head: bool) -> None:
    """Leave the Ray Client server and the autoscaler's monitor out of a head's processes
    (``params``: Ray's ``RayParams``); a worker node joining a head is left as it is."""
    if head:
        params.ray_client_server_port = None
        params.no_monitor = True
