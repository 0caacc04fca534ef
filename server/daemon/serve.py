"""``fedge serve``: the coordinator as a long-running service on Flower's own SuperLink.

What it does, in order: check the config (``fedge.server.daemon.service_config``); start ``flower-superlink``
with its state database (``<state-dir>/superlink.db``: registered nodes and run history survive a
restart), TLS and SuperNode authentication as configured; register the configured node keys; serve
``/metrics`` and ``/healthz``; submit the Fedge app with ``flwr run`` and supervise it, logging one
JSON object per event (round completed, reply rejected, nodes online, stop, exit).

Lifecycle:

* the run finishes → every process is stopped, exit 0;
* SIGTERM / SIGINT → the run is asked to stop at the next round boundary (``<run>/stop-requested``,
  checked by the engine right after each checkpoint); the daemon waits up to ``stop-grace-seconds``,
  then stops everything and exits 0. A round cut short by the grace limit is simply run again:
  the checkpoint is only ever written after a complete round;
* restart (systemd ``Restart=on-failure``, or by hand) → the SuperLink reopens its database, the
  Fedge app resumes from the last checkpoint (``rounds`` rows exactly once);
* the SuperLink or the run fails → everything is stopped and started again, as a restart would, and
  the run resumes from its checkpoint (the log says what failed and why). The SuperLink and the
  ServerApp can fail for reasons outside Fedge (seen: the SuperLink answering the ServerApp's
  ``pull-messages`` with HTTP 500 on a 2-core machine at load 15); a daemon that gave up there would
  leave the run to an outside supervisor. After ``run-retries`` failures in a row with no round
  completed in between (a crash loop, e.g. a run that cannot start) it stops and exits 1.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from typing import Any

from fedge.launcher.environment import flower_environment
from fedge.launcher.flower_cli import FlowerCli, FlowerCliError, json_replies
from fedge.launcher.processes import ProcessGroup
from fedge.launcher.sequence import FlowerLaunch
from fedge.server.daemon.json_logs import fields
from fedge.server.daemon.service_config import ServiceConfig
from fedge.server.flower_app import stage_run_app
from fedge.server.run.metrics_log import MetricsLog
from fedge.server.run.run_directory import RunDirectory
from fedge.server.daemon.service_metrics import MetricsServer, ServiceMetrics
from fedge.server.live.server import LivePage

__all__ = ["Daemon"]

log = logging.getLogger("fedge.serve")

_CONNECTION = "fedge"
#: what _supervise returns when the run failed and may be restarted
_FAILED = -1


class Daemon:
    #: first wait before restarting a failed run, doubled per failure in a row (at most 60 s)
    restart_backoff = 5.0

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.flwr_home = config.state_dir / "flwr-home"
        self.env = flower_environment(self.flwr_home)
        self.run_directory = RunDirectory(config.run_dir)
        self.metrics = ServiceMetrics(self.run_directory.checkpoints.current)
        self.stop = threading.Event()
        self.group: ProcessGroup | None = None
        self.metrics_server: MetricsServer | None = None
        self.live_page: LivePage | None = None
        #: the SuperLink's node list at the last poll (``flwr supernode ls``), for the live page
        self._nodes: list[dict[str, Any]] | None = None
        self._superlink = None
        self._runner = None
        self._round = 0
        self._submitted_at = 0.0
        #: Flower's id of the run this daemon submitted, once its ServerApp has recorded it
        self._run_id: int | None = None
        self._detached = False  # flwr run's stream ended while the run went on
        self._status_checked_at = -1e9
        self._run_status: tuple[str | None, str] = (None, "")
        #: the supervision loop's last answer from _run_alive; /healthz and the node poller read it
        #: instead of asking Flower themselves (no `flwr ls` from an HTTP handler or a second thread)
        self._run_going = False
        self._attempt = 0  # supervision attempts of this process (a restart after a failure adds one)
        self._seen = 0  # metrics rows reported so far
        #: the one process that answers the daemon's `flwr` calls (stopped with each attempt's processes)
        self._flwr = FlowerCli(self.env, cwd=config.state_dir)

    # -- signals --------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.stop.is_set():
            log.info("signal received: stopping after the current round",
                     extra=fields(signal=signal.Signals(signum).name))
        self.stop.set()

    # -- health -----------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        superlink = self._superlink is not None and self._superlink.alive()
        runner = self._run_going
        return {"ok": bool(superlink and runner), "superlink": superlink, "run": runner,
                "run_id": self._run_id, "round": self._round, "stopping": self.stop.is_set()}

    def _run_alive(self) -> bool:
        self._run_going = self._run_still_going()
        return self._run_going

    def _run_still_going(self) -> bool:
        """The run goes on while ``flwr run`` streams its logs, or, once that client has gone, while
        the SuperLink reports the run as not finished. ``flwr run --stream`` was seen exiting 0 in
        the middle of a run (10 SuperNodes on 2 cores); the ServerApp runs under the SuperLink, not
        under ``flwr run``, so the daemon keeps supervising it through ``flwr ls``."""
        if self._runner is None:
            return False
        if self._runner.alive():
            return True
        if self._run_id is None:
            return False
        now = time.monotonic()
        if now - self._status_checked_at >= 5.0:
            self._status_checked_at = now
            self._run_status = self._flower_run_status()
            status = self._run_status[0]
            if status is not None and not status.startswith("finished") and not self._detached:
                self._detached = True  # (a stream that ends with the run is the normal case: no warning)
                log.warning("flwr run's log stream ended; supervising the run through the SuperLink",
                            extra=self._fields(status=self._run_status[0], code=self._runner.popen.returncode))
        status = self._run_status[0]
        return status is not None and not status.startswith("finished")

    def _flower_run_status(self) -> tuple[str | None, str]:
        """``(status, details)`` of this daemon's run as the SuperLink reports it (``flwr ls``);
        ``(None, why)`` when it cannot be asked."""
        try:
            runs = self._flwr_json(["ls", _CONNECTION, "--run-id", str(self._run_id)]).get("runs") or []
        except (FlowerCliError, ValueError, AttributeError) as err:
            return None, str(err)
        if not runs:
            return None, "the SuperLink does not know the run"
        return str(runs[0].get("status")), str(runs[0].get("status-details", ""))

    def _flwr_json(self, args: list[str]) -> Any:
        """Flower's JSON answer to ``flwr ARGS --format json``, from the daemon's one ``flwr`` process
        (:class:`~fedge.launcher.flower_cli.FlowerCli`: the node poll and the run's status would
        otherwise start a process each, 1.4 CPU-s of imports a call, for as long as the daemon serves)."""
        code, text = self._flwr.call([*args, "--format", "json"], timeout=60)
        replies = json_replies(text)
        if len(replies) != 1:
            raise ValueError(f"flwr {' '.join(args[:2])} answered {code}: {text.strip()[-300:]!r}")
        return replies[0]

    def _fields(self, **values: Any) -> dict[str, Any]:
        """Event fields with Flower's run id, so a line can be matched with ``flwr log <run id>``."""
        return fields(run=self._run_id, **values) if self._run_id is not None else fields(**values)

    def _learn_run_id(self) -> None:
        """The ServerApp writes ``flower_run_id`` and ``started_at`` into ``<run>/config.json`` when it
        starts; a record older than this daemon's submission belongs to an earlier process (a resumed
        run gets a new Flower run id) and is ignored."""
        if self._run_id is not None:
            return
        try:
            record = json.loads((self.config.run_dir / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if isinstance(record, dict) and float(record.get("started_at") or 0) >= self._submitted_at - 1.0:
            run_id = record.get("flower_run_id")
            if isinstance(run_id, int):
                self._run_id = run_id
                log.info("run started", extra=self._fields(run_dir=str(self.config.run_dir)))

    # -- main loop --------------------------------------------------------------------------------
    def run(self) -> int:
        config = self.config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        config.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_directory.prepare_launch(config.settings)  # clears a stale stop request; refuses a bad resume
        rows_log = MetricsLog(config.run_dir / "metrics.jsonl")
        for row in rows_log.read():  # the run so far: counters are totals of the run, not of this process
            self.metrics.observe_row(row)
            self._round = int(row.get("round", 0))
            self._seen += 1
        failures, rounds_at_failure = 0, -1
        try:
            while True:
                code = self._attempt_once(rows_log)
                if code != _FAILED:
                    return code
                failures = failures + 1 if self._round == rounds_at_failure else 1
                rounds_at_failure = self._round
                if failures > config.run_retries:
                    log.error("the run failed again without completing a round: giving up",
                              extra=fields(failures=failures, run_retries=config.run_retries, round=self._round))
                    return 1
                wait = min(60.0, self.restart_backoff * 2 ** (failures - 1))
                log.warning("restarting the SuperLink and the run from its checkpoint",
                            extra=fields(failure=failures, of=config.run_retries, round=self._round, wait=wait))
                if self.stop.wait(wait):
                    log.info("signal received while waiting to restart: stopping")
                    return 0
        finally:
            if self.metrics_server is not None:
                self.metrics_server.stop()
            if self.live_page is not None:
                self.live_page.stop()

    def _attempt_once(self, rows_log: MetricsLog) -> int:
        """Start the SuperLink and the run, supervise them, and stop every process they left."""
        self._attempt += 1
        self._run_id, self._detached, self._run_status = None, False, (None, "")
        self._status_checked_at = -1e9
        self._stop_leftovers()
        self.group = ProcessGroup(self.config.state_dir / "logs", env=self.env,
                                  also_match={"FLWR_HOME": str(self.flwr_home)})
        try:
            return self._supervise(rows_log)
        finally:
            self._run_going = False
            self._flwr.close()
            self.group.stop()
            log.info("all processes stopped")

    def _stop_leftovers(self) -> None:
        """A daemon killed with SIGKILL cannot stop its SuperLink, ServerApp or ``flwr run``: they keep
        the port and the database. Every one of them carries this daemon's FLWR_HOME in its
        environment; stop them before starting again (they are ours by construction)."""
        leftovers = ProcessGroup(self.config.state_dir / "logs", env=self.env,
                                 also_match={"FLWR_HOME": str(self.flwr_home)})
        found = leftovers.stragglers()
        if found:
            log.warning("stopping processes left by a previous daemon", extra=fields(pids=found))
            leftovers.stop(grace=5.0)

    def _register_keys(self, flower: FlowerLaunch) -> None:
        """Register every configured SuperNode key with Flower's ``flwr supernode register``, in the
        process that answers the daemon's polls (``fedge.launcher.flower_cli``): a ``flwr`` process
        per key spends ~1.4 CPU-s on imports, paid at every daemon start. A key registered before (a
        persistent database) is logged and kept."""
        keys = list(self.config.register_keys)
        for key, node in zip(keys, flower.register([(key, None) for key in keys], registered_ok=True, cli=self._flwr)):
            if node is None:
                log.info("node key already registered", extra=fields(key=str(key)))
            else:
                log.info("node key registered", extra=fields(key=str(key), node=node))

    def _supervise(self, rows_log: MetricsLog) -> int:
        config, group = self.config, self.group
        assert group is not None
        flower = FlowerLaunch(group, self.flwr_home, _CONNECTION)
        self._superlink = flower.start_superlink(host=config.host, port=config.port, tls=config.tls,
                                                 database=config.database, dial=config.dial, cwd=config.state_dir)
        log.info("SuperLink listening", extra=fields(address=f"{config.host}:{config.port}", tls=bool(config.tls),
                                                      node_auth=bool(config.tls and config.tls.node_auth),
                                                      database=str(config.database)))
        self._register_keys(flower)
        if config.page_host and self.live_page is None:  # one page for every attempt
            self.live_page = LivePage(config.run_dir, config.page_host, config.page_port, token=config.page_token,
                                      tls=(config.tls.certificate, config.tls.key) if config.page_token and config.tls
                                      else None, online=lambda: self._nodes).start()
            log.info("live page served", extra=fields(url=self.live_page.url.split("?")[0]))
        if config.metrics_host and self.metrics_server is None:  # one server for every attempt
            self.metrics_server = MetricsServer(self.metrics, config.metrics_host, config.metrics_port,
                                                self.health).start()
            log.info("metrics served", extra=fields(url=f"http://{config.metrics_host}:{self.metrics_server.port}/metrics"))
        self._submitted_at = time.time()
        self._runner = flower.submit(stage_run_app(self.flwr_home / "app", config.settings.task, plugins=config.settings.plugins), config.settings.to_run_config(),
                                     cwd=config.run_dir)
        log.info("run submitted", extra=fields(run_dir=str(config.run_dir), rounds=config.settings.rounds,
                                               algorithm=config.settings.algorithm))
        self._run_going = True
        poller = threading.Thread(target=self._poll_nodes, args=(self._attempt,), name="fedge-node-poll",
                                  daemon=True)
        poller.start()
        stop_asked_at: float | None = None
        while True:
            self.metrics.superlink_up.set(1 if self._superlink.alive() else 0)
            self._learn_run_id()
            self._report_rows(rows_log)
            if not self._run_alive():
                self._report_rows(rows_log)
                return self._finish(stop_asked_at is not None)
            if not self._superlink.alive():
                log.error("SuperLink exited", extra=self._fields(code=self._superlink.popen.returncode,
                                                           log_tail=self._superlink.log_tail(10)))
                return _FAILED
            if self.stop.is_set():
                if stop_asked_at is None:
                    stop_asked_at = time.monotonic()
                    self.run_directory.request_stop()
                elif time.monotonic() - stop_asked_at > config.stop_grace_seconds:
                    log.warning("the round did not finish within stop-grace-seconds: stopping now; it runs "
                                "again after a restart", extra=self._fields(grace=config.stop_grace_seconds))
                    return 0
            time.sleep(0.5)

    def _finish(self, stopping: bool) -> int:
        code = self._runner.popen.returncode
        summary = self.config.run_dir / "summary.json"
        if summary.exists():
            data = json.loads(summary.read_text())
            log.info("run finished", extra=self._fields(rounds=data.get("rounds"), accuracy=data.get("final_accuracy")))
            return 0
        if stopping and code == 0:
            log.info("run stopped at a round boundary; restart to resume", extra=self._fields(round=self.health()["round"]))
            return 0
        status, details = self._flower_run_status() if self._run_id is not None else (None, "")
        log.error("the run failed", extra=self._fields(code=code, flower_status=status, flower_details=details,
                                                        log_tail=self._runner.log_tail(20)))
        return _FAILED

    def _report_rows(self, rows_log: MetricsLog) -> None:
        """Log and count the rows written since the last call. After a restart the ServerApp drops
        rows past the checkpoint (at most the one written before a crash could checkpoint it) and
        runs that round again; its second row is then not reported (the first one was)."""
        rows = rows_log.read()
        for row in rows[self._seen:]:
            self.metrics.observe_row(row)
            self._round = int(row.get("round", self._round))
            log.info("round completed", extra=self._fields(
                round=row.get("round"), accuracy=row.get("accuracy"), clients_used=row.get("clients_used"),
                uplink_bytes=row.get("uplink_bytes"), seconds=row.get("seconds")))
            for item in row.get("rejected") or []:
                log.warning("reply rejected", extra=self._fields(round=row.get("round"), node=item.get("node"),
                                                           reason=item.get("reason")))
        self._seen = max(self._seen, len(rows))

    def _poll_nodes(self, attempt: int) -> None:
        """The SuperLink's own count of online SuperNodes, through ``flwr supernode ls``, for as long
        as the run of supervision attempt ``attempt`` goes on."""
        last = None
        while not self.stop.is_set() and self._run_going and self._attempt == attempt:
            try:
                nodes = self._flwr_json(["supernode", "ls", _CONNECTION]).get("nodes", [])
                self._nodes = [n for n in nodes if isinstance(n, dict)]
                online = sum(1 for n in nodes if n.get("status") == "online")
                self.metrics.nodes.set(online)
                if online != last:
                    log.info("nodes online", extra=self._fields(nodes=online))
                    last = online
            except (FlowerCliError, ValueError, AttributeError) as err:
                log.warning("could not list nodes", extra=self._fields(error=str(err)))
            self.stop.wait(self.config.node_poll_seconds)

