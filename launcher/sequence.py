"""The one launch sequence of a Flower federation: SuperLink, wait, SuperNodes, ``flwr run``, follow.

``fedge demo`` / ``local-cluster`` (``fedge.server.local``), the daemon (``fedge serve``), the
benchmarks and the tests all start Flower through :class:`FlowerLaunch`, so the order of the steps,
the connection file ``flwr`` reads and the checks between steps are written once::

    with ProcessGroup(logs, env=flower_environment(home)) as group:
        flower = FlowerLaunch(group, home)
        flower.start_superlink(simulation=False)          # writes the connection, waits for the port
        flower.start_supernode(0, {"partition-id": 0, "num-partitions": 1})
        runner = flower.submit(app_dir, {"rounds": 3})    # flwr run <app> <connection> --stream
        flower.follow(runner, deadline, on_tick=...)      # until flwr run exits; fails if a process dies

Every process belongs to the caller's :class:`~fedge.launcher.processes.ProcessGroup`, which stops
all of them (and their descendants) on exit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedge.launcher.environment import config_args, node_config_arg, supernode_home
from fedge.launcher.federation import ServerTLS, register_nodes, superlink_argv, supernode_argv, write_connection
from fedge.launcher.flower_cli import FlowerCli
from fedge.launcher.isolation import choose_isolation, supernode_isolation_argv, warm_executor_argv, write_secret
from fedge.launcher.processes import ManagedProcess, ProcessGroup, free_port, wait_for_port

__all__ = ["FlowerLaunch", "LaunchError"]

#: seconds a SuperLink gets to listen on its port
STARTUP_TIMEOUT = 60.0


class LaunchError(RuntimeError):
    """A Flower process exited early or the run did not finish in time; the message says where to look."""


class FlowerLaunch:
    """The steps of starting a federation, in a process group, against one ``flwr`` connection."""

    def __init__(self, group: ProcessGroup, flwr_home: Path, connection: str = "fedge",
                 isolation: str = "warm") -> None:
        """``isolation``: how SuperNodes run messages (``fedge.launcher.isolation``); ``warm`` falls
        back to ``subprocess`` with a logged reason where it cannot run."""
        self.group = group
        self.flwr_home = Path(flwr_home)
        self.connection = connection
        self.address = ""
        self.root_cert: Path | None = None
        self.isolation = choose_isolation(isolation)
        self.warm_nodes: list[tuple[str, Path | None]] = []
        self.warm_executor: ManagedProcess | None = None

    def start_superlink(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        tls: ServerTLS | None = None,
        database: Path | None = None,
        simulation: bool = False,
        dial: str | None = None,
        cwd: Path | None = None,
        timeout: float = STARTUP_TIMEOUT,
        meanwhile: Callable[[], object] | None = None,
    ) -> ManagedProcess:
        """Start ``flower-superlink``, write the connection ``flwr`` uses to reach it (``dial``,
        default ``host:port``), and return once it accepts connections. ``meanwhile`` runs while it
        starts (a Python SuperLink takes a second or two to listen): work the next steps need that
        does not need the SuperLink, such as the run's partitions; an error there propagates, and
        the caller's group stops the SuperLink."""
        port = port or free_port()
        self.address = dial or f"{host}:{port}"
        self.root_cert = tls.ca_cert if tls else None
        write_connection(self.flwr_home, self.connection, self.address, self.root_cert)
        superlink = self.group.start(
            "superlink", superlink_argv(host, port, tls, database=database, simulation=simulation), cwd=cwd
        )
        if meanwhile is not None:
            meanwhile()
        dial_host, _, dial_port = self.address.rpartition(":")
        wait_for_port(int(dial_port), timeout, superlink, host=dial_host)
        return superlink

    def register(self, keys: Sequence[tuple[Path, str | None]], registered_ok: bool = False,
                 cli: FlowerCli | None = None) -> list[int | None]:
        """Register SuperNodes' public keys (each with its name) with the running SuperLink, in one
        process (``cli``, or one for these keys: ``fedge.launcher.federation.register_nodes``); their
        node ids."""
        return register_nodes(keys, self.connection, self.group.env, registered_ok=registered_ok, cli=cli)

    def start_supernode(
        self,
        index: int,
        node_config: Mapping[str, Any],
        *,
        auth_key: Path | None = None,
        cwd: Path | None = None,
    ) -> ManagedProcess:
        """A SuperNode dialing the SuperLink, with its own FLWR_HOME (ten nodes installing the app
        into one shared home raced: one saw a half-written app directory). Under warm isolation its
        messages run in the one warm process :meth:`start_warm_executor` starts for all nodes."""
        home = supernode_home(self.flwr_home, index)
        port = free_port()
        secret = write_secret(self.flwr_home / "superexec.secret") if self.isolation == "warm" else None
        node = self.group.start(
            f"supernode-{index}",
            supernode_argv(self.address, port, node_config_arg(node_config), root_cert=self.root_cert,
                           auth_key=auth_key, extra=supernode_isolation_argv(self.isolation, secret)),
            cwd=cwd, env={"FLWR_HOME": str(home)},
        )
        if self.isolation == "warm":
            self.warm_nodes.append((f"127.0.0.1:{port}", home))
        return node

    @property
    def warm_ledger(self) -> Path:
        """The warm process's record of every message it ran (``fedge.edge_client.warm_executor``)."""
        return self.group.log_dir / "warm-messages.jsonl"

    def start_warm_executor(self, cwd: Path | None = None, *, partitions: bool = True) -> ManagedProcess | None:
        """The one warm process for every SuperNode started so far (none under subprocess
        isolation); ``partitions``: the nodes build their share of a shared data set."""
        if self.isolation != "warm" or not self.warm_nodes:
            return None
        self.warm_executor = self.group.start(
            "warm-executor", warm_executor_argv(self.warm_nodes, self.flwr_home / "superexec.secret",
                                                ledger=self.warm_ledger, partitions=partitions), cwd=cwd)
        return self.warm_executor

    def submit(
        self,
        app_dir: Path,
        run_config: Mapping[str, Any],
        *,
        federation_config: Mapping[str, Any] | None = None,
        cwd: Path | None = None,
    ) -> ManagedProcess:
        """``flwr run <app_dir> <connection> --stream`` with the run config, one flag per key. Under
        warm isolation the warm process is started first if the caller has not (a SuperNode in
        process isolation runs nothing by itself)."""
        if self.isolation == "warm" and self.warm_nodes and self.warm_executor is None:
            self.start_warm_executor(cwd=cwd)
        argv = ["flwr", "run", str(app_dir), self.connection, "--stream", *config_args("--run-config", run_config)]
        if federation_config:
            argv += config_args("--federation-config", federation_config)
        return self.group.start("flwr-run", argv, cwd=cwd)

    def follow(
        self,
        runner: ManagedProcess,
        deadline: float,
        on_tick: Callable[[], bool] | None = None,
        *,
        interval: float = 0.3,
    ) -> bool:
        """Call ``on_tick`` every ``interval`` s until ``flwr run`` exits (True) or ``on_tick``
        returns True (False: the caller ended it early). Raise :class:`LaunchError` when another
        process of the group exits first or at ``deadline`` (a ``time.monotonic`` value)."""
        while True:
            finished = not runner.alive()
            if on_tick is not None and on_tick():
                return False
            if finished:
                return True
            if time.monotonic() > deadline:
                raise LaunchError(f"the run did not finish in time; logs in {self.group.log_dir}")
            for process in self.group.processes:
                if process is not runner and not process.alive():
                    raise LaunchError(
                        f"{process.name} exited with code {process.popen.returncode}; "
                        f"log {process.log_path}:\n{process.log_tail()}"
                    )
            time.sleep(interval)
