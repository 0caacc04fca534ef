"""The environment of every Flower process Fedge starts, and run-config arguments for ``flwr``.

Telemetry, update checks, runtime dependency installation (which would ``uv sync`` a multi-GB CUDA
torch per run) and hub access are switched off; Ray starts its own instance unless ``RAY_ADDRESS``
names a cluster; each run gets its own ``FLWR_HOME`` so concurrent
runs and tests never collide with each other or with a user's ``~/.flwr``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["config_args", "flower_environment", "node_config_arg", "supernode_home", "toml_value"]


def flower_environment(flwr_home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every Flower process of a run gets (see the module docstring for why)."""
    env = dict(base if base is not None else os.environ)
    venv_bin = str(Path(sys.executable).parent)  # flower-superexec etc. are looked up on PATH
    env.update(
        {
            "FLWR_HOME": str(flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_DEDUP_LOGS": "0",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            # Flower's SuperExec looks for a new task (a ClientApp / ServerApp to start) once a second
            # by default; every deployment message waits half of that on average. 0.2 s is Flower's
            # own knob (flwr 1.41 supercore/superexec/run_superexec.py), a user's value wins.
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": env.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2"),
            "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
            # Simulation: a Ray instance of the run's own unless the caller names a cluster. Without
            # it ray.init() joins the cluster named in Ray's current-cluster file, left in its temp
            # directory by any earlier `ray start`, and a dead one there hangs the run.
            "RAY_ADDRESS": env.get("RAY_ADDRESS") or "local",
        }
    )
    return env


def supernode_home(flwr_home: Path, index: int) -> Path:
    """The FLWR_HOME of a loopback SuperNode: inside the run's, so one sweep finds every process."""
    return flwr_home / "supernodes" / str(index)


def toml_value(value: Any) -> str:
    """A Python scalar as a TOML value (Flower parses run and node config values as TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def config_args(flag: str, values: Mapping[str, Any]) -> list[str]:
    """``{"rounds": 3}`` -> ``["--run-config", "rounds=3"]`` (one flag per key: no quoting traps)."""
    out: list[str] = []
    for key, value in values.items():
        out += [flag, f"{key}={toml_value(value)}"]
    return out


def node_config_arg(values: Mapping[str, Any]) -> str:
    """``{"partition-id": 0, "data": "/x.npz"}`` -> ``partition-id=0 data="/x.npz"`` for ``--node-config``."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())
