"""Run the Fedge app on Flower's engines, on this machine, with every process accounted for.

* ``simulation``: a SuperLink in ``--simulation`` mode; Flower's Simulation Engine (Ray) runs the
  virtual SuperNodes.
* ``deployment``: a SuperLink and N real ``flower-supernode`` processes on 127.0.0.1, each with its own
  partition (``--node-config 'partition-id=i num-partitions=N'``), as on real devices.

Both submit the app with ``flwr run <app dir> <connection> --run-config ...`` against a connection
written to this run's own ``FLWR_HOME``, on free ports, so concurrent runs and tests never collide
with each other or with a user's ``~/.flwr``. The environment switches off telemetry, update checks,
runtime dependency installation (which would ``uv sync`` a multi-GB CUDA torch per run) and hub
access. Progress comes from the run directory's ``metrics.jsonl``, the same file users read.

The app is submitted from a staged copy holding only what the FAB carries (``pyproject.toml`` and the
files its ``fab-include`` patterns name): ``flwr run`` walks and resolves every file under the
directory it is given before it filters (flwr 1.41 ``collect_files``), which in a checkout with its
``.venv`` is some 50,000 files and 5-10 s per launch. The bundle's content is the same.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10; flwr depends on tomli there
    import tomli as tomllib

from server.federation import LoopbackSecurity, register_node, superlink_argv, supernode_argv, write_connection
from server.processes import ManagedProcess, ProcessGroup, free_port, wait_for_port
from server.settings import RunSettings

__all__ = ["APP_DIR", "EngineError", "LaunchResult", "flower_environment", "launch", "supernode_home"]

log = logging.getLogger(__name__)

#: The Flower app directory: the checkout holding pyproject.toml with [tool.flwr.app].
APP_DIR = Path(__file__).resolve().parent.parent
_STARTUP_TIMEOUT = 60.0


class EngineError(RuntimeError):
    """The engine or the run failed; the message says where to look."""


@dataclass
class LaunchResult:
    run_dir: Path
    rows: list[dict[str, Any]]
    summary: dict[str, Any] | None
    seconds: float
    logs: dict[str, Path] = field(default_factory=dict)


def supernode_home(flwr_home: Path, index: int) -> Path:
    """The FLWR_HOME of a loopback SuperNode: inside the run's, so one sweep finds every process."""
    return flwr_home / "supernodes" / str(index)


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
        }
    )
    return env


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def config_args(flag: str, values: Mapping[str, Any]) -> list[str]:
    """``{"rounds": 3}`` -> ``["--run-config", "rounds=3"]`` (one flag per key: no quoting traps)."""
    out: list[str] = []
    for key, value in values.items():
        out += [flag, f"{key}={_toml_value(value)}"]
    return out


def launch(
    settings: RunSettings,
    *,
    engine: str,
    num_supernodes: int,
    flwr_home: Path | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    timeout: float = 3600.0,
    stop_after_round: int | None = None,
    node_config: Mapping[int, Mapping[str, str | int | float]] | None = None,
    parallel_clients: int = 0,
    tls: bool = False,
) -> LaunchResult:
    """Start the engine, run the app to completion (or ``stop_after_round``), stop every process.

    ``stop_after_round`` kills all processes with SIGKILL as soon as that round's metrics line is
    written: a simulated crash of the whole installation, used by the resume test.
    ``node_config`` (deployment only) adds keys to SuperNode ``i``'s node config, e.g.
    ``{1: {"slowdown": 3}}`` for a device three times slower or ``{1: {"fault": "bitflip"}}`` for
    one that corrupts its updates (chaos testing).
    ``parallel_clients`` (simulation only): how many ClientApps Ray runs at once; default one per
    core. Straggler runs set it to the number of clients, so that a slow client sleeping through
    its slowdown occupies its own simulated device, as on real hardware, not one of the few slots
    every other client is queued behind.
    ``tls`` (deployment only): TLS and SuperNode authentication on, as in a real deployment: a CA,
    server certificate and node keys are made in ``<run dir>/tls`` (``deploy/certs.py``), every
    node key is registered with ``flwr supernode register`` before its SuperNode starts.
    """
    if engine not in ("simulation", "deployment"):
        raise ValueError(f"engine must be 'simulation' or 'deployment', got {engine!r}")
    if not settings.run_dir:
        raise ValueError("launch needs an explicit run directory")
    run_dir = Path(settings.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # A summary is the mark of a finished run: drop a stale one so only this launch can write it.
    (run_dir / "summary.json").unlink(missing_ok=True)
    prepare_run_directory(run_dir)
    flwr_home = (flwr_home or run_dir / "flwr-home").resolve()
    env = flower_environment(flwr_home)
    started = time.monotonic()
    if tls and engine != "deployment":
        raise ValueError("tls applies to the deployment engine (simulated nodes do not connect)")
    security = LoopbackSecurity.create(run_dir / "tls", num_supernodes) if tls else None
    root_cert = security.server.ca_cert if security else None
    port = free_port()
    write_connection(flwr_home, "fedge", f"127.0.0.1:{port}", root_cert)
    run_config = settings.replace(run_dir=str(run_dir)).to_run_config()

    group = ProcessGroup(run_dir / "logs", env=env, also_match={"FLWR_HOME": env["FLWR_HOME"]})
    try:
        superlink = group.start(
            "superlink",
            superlink_argv("127.0.0.1", port, security.server if security else None,
                           simulation=engine == "simulation"),
            cwd=run_dir,
        )
        wait_for_port(port, _STARTUP_TIMEOUT, superlink)
        federation_args: list[str] = []
        if engine == "deployment":
            for i in range(num_supernodes):
                # cache-dir: each node reads its partition from a small .npz instead of rebuilding
                # it (scikit-learn, datasets) in every ClientApp process (edge_client/node_data.py).
                config = (f"partition-id={i} num-partitions={num_supernodes} "
                          f"cache-dir={_toml_value(str(run_dir / 'node-cache'))}")
                for key, value in ((node_config or {}).get(i) or {}).items():
                    config += f" {key}={_toml_value(value)}"
                auth_key = None
                if security:
                    auth_key = security.node_key(i)
                    register_node(auth_key.with_suffix(".pub"), "fedge", env, name=f"node-{i}")
                # Each SuperNode installs the app into its own FLWR_HOME, as separate devices do: ten
                # nodes installing into one shared home raced (one saw a half-written app directory).
                group.start(
                    f"supernode-{i}",
                    supernode_argv(f"127.0.0.1:{port}", free_port(), config, root_cert=root_cert,
                                   auth_key=auth_key),
                    cwd=run_dir, env={"FLWR_HOME": str(supernode_home(flwr_home, i))},
                )
        else:
            federation_args = config_args(
                "--federation-config",
                {
                    "num-supernodes": num_supernodes,
                    "client-resources-num-cpus": 1,
                    # Ray schedules one actor per logical CPU it is told about (Flower takes whole
                    # CPUs only): more logical CPUs than cores means more ClientApps at once.
                    "init-args-num-cpus": max(1, os.cpu_count() or 1, parallel_clients),
                },
            )
        runner = group.start(
            "flwr-run",
            ["flwr", "run", str(stage_app(flwr_home / "app")), "fedge", "--stream",
             *config_args("--run-config", run_config), *federation_args],
            cwd=run_dir,
        )
        rows = _follow(run_dir, runner, group, on_row, started + timeout, stop_after_round)
    finally:
        group.stop()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return LaunchResult(
        run_dir=run_dir,
        rows=rows,
        summary=summary,
        seconds=time.monotonic() - started,
        logs={p.stem: p for p in (run_dir / "logs").glob("*.log")},
    )


def stage_app(destination: Path, source: Path = APP_DIR) -> Path:
    """Copy the files of the app bundle (``pyproject.toml`` + ``fab-include``) to ``destination``."""
    pyproject = source / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"].get("fab-include")
    if not patterns:
        raise EngineError(f"{pyproject} has no [tool.flwr.app] fab-include patterns to stage the app with")
    shutil.rmtree(destination, ignore_errors=True)
    destination.mkdir(parents=True)
    shutil.copy2(pyproject, destination / "pyproject.toml")
    for pattern in patterns:
        for path in source.glob(pattern):
            if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
                target = destination / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    return destination


def prepare_run_directory(run_dir: Path) -> None:
    """Before a (re)start: clear a stop request of an earlier launch, and drop metrics rows past the
    last checkpoint (they belong to rounds that will run again; the ServerApp does the same when it
    resumes) so progress does not report them twice."""
    from server.run_directory import RunDirectory

    directory = RunDirectory(run_dir)
    directory.clear_stop()  # a stop asked of an earlier launch is not a stop of this one
    checkpoint = directory.checkpoints.load()
    directory.metrics.truncate_after(checkpoint.round if checkpoint else 0)


def _follow(
    run_dir: Path,
    runner: ManagedProcess,
    group: ProcessGroup,
    on_row: Callable[[dict[str, Any]], None] | None,
    deadline: float,
    stop_after_round: int | None,
) -> list[dict[str, Any]]:
    """Report metrics rows as they appear until ``flwr run`` exits; raise on failure or timeout."""
    from server.metrics_log import MetricsLog

    metrics = MetricsLog(run_dir / "metrics.jsonl")
    seen = 0
    rows: list[dict[str, Any]] = []
    while True:
        finished = not runner.alive()
        rows = metrics.read()
        for row in rows[seen:]:
            if on_row:
                on_row(row)
            if stop_after_round is not None and row["round"] >= stop_after_round:
                log.info("simulating a crash after round %d: killing every process", row["round"])
                group.kill_all()
                return rows
        seen = len(rows)
        if finished:
            break
        if time.monotonic() > deadline:
            raise EngineError(f"run did not finish in time; logs in {run_dir / 'logs'}")
        for process in group.processes:
            if process is not runner and not process.alive():
                raise EngineError(
                    f"{process.name} exited with code {process.popen.returncode}; "
                    f"log {process.log_path}:\n{process.log_tail()}"
                )
        time.sleep(0.3)
    if runner.popen.returncode != 0 or not (run_dir / "summary.json").exists():
        raise EngineError(
            f"the Flower run failed (flwr run exit code {runner.popen.returncode}); "
            f"logs in {run_dir / 'logs'}:\n{runner.log_tail(30)}"
        )
    return rows
