"""Warm execution: one device process with Python, torch, Flower and Fedge imported once, forking a
fresh child for every message.

Flower's default (``flower-supernode`` with ``--isolation subprocess``) starts a SuperExec that
launches a new ``flwr-clientapp`` process for every message; each one imports Python, torch, flwr and
Fedge again, which cost a device 9-14x its training CPU (docs/results.md). Flower documents the way
out: ``flower-supernode --isolation process`` serves its Runtime API and starts nothing; a process
of the operator's choosing claims each task (``AcquireTask``, the same call Flower's own SuperExec
makes, authenticated with the SuperExec shared secret) and runs it with the task's token. This module
is that process. It imports the heavy modules once, then for each task it ``fork()``\\ s a child
that runs Flower's own ``run_clientapp`` (pull the message, install the run's FAB, load its ClientApp
by FAB hash, push the reply, exit), except that a node pinned to its owner's installed ClientApp runs
that one and refuses a FAB that names another (``fedge.edge_client.device_code``). A FAB's bytes are extracted and checked by Flower once per node,
not once per message (:func:`install_once`).

Why a fresh fork per message, not a worker per run: a forked child starts in microseconds with every
module already imported and shares the parent's pages copy-on-write, and it ends with its message,
so nothing of one message (a run's app modules, globals, a leaked thread, a crash) reaches the next
one: a second run with another app loads its own code from its own FAB in its own child, and a child
that dies (even by SIGKILL) takes nothing with it. The parent never imports a run's app code. A
worker per run would save the FAB load (milliseconds) but keep a run's state between messages,
which Flower's process model promises not to.

The parent stays single-threaded while it forks (no OpenMP pool, no torch op, no thread of its own),
so the child inherits no lock held by another thread. Where fork is not safe or not there (Windows,
macOS's Objective-C runtime, a Flower without the Runtime API)
:func:`fedge.launcher.isolation.warm_unavailable` says why and the caller uses Flower's subprocess isolation instead.

One warm process may serve several SuperNodes (``fedge local-cluster``): every node is polled in
turn, and each child sets its node's ``FLWR_HOME`` before it installs the FAB.

    python -m fedge.edge_client.warm_executor --node 127.0.0.1:9094=/path/flwr-home --secret-file s
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedge.edge_client.page_release import release_file_pages
from fedge.launcher.isolation import warm_unavailable

__all__ = ["PAGE_RELEASE_ENV", "PARTITION_PRELOAD", "PRELOAD", "WarmExecutor", "WarmNode", "main"]

log = logging.getLogger("fedge.edge.warm")

#: What every message needs and the parent imports once: torch, Flower's ClientApp runtime, the Fedge
#: ClientApp and the library under it (codecs, tasks, the device's algorithms).
PRELOAD = (
    "numpy",
    "torch",
    "flwr.clientapp",
    "flwr.supernode.runtime.run_clientapp",
    "fedge.edge_client.app",
    "fedge.tasks",
    "fedge.compression.kernels",
)
#: ``off``: keep the imports' clean file pages resident (``fedge.edge_client.page_release``)
PAGE_RELEASE_ENV = "FEDGE_PAGE_RELEASE"
#: what a node that builds its own partition of a shared data set needs on its first message (a local
#: cluster whose launcher could not draw the partitions ahead, a user's task found only in the app; a
#: device with its own data file never imports them)
PARTITION_PRELOAD = ("sklearn.datasets", "flwr_datasets")

#: The Runtime API method Flower's SuperNode guards with the SuperExec secret (run_superexec.py)
_ACQUIRE = "/flwr.proto.Runtime/AcquireTask"

#: Poll intervals: right after a task a node is asked again soon (a round's next message follows),
#: then less and less often, never slower than Flower's own SuperExec (1 s).
FAST_POLL, SLOW_POLL = 0.05, 0.5


@dataclass
class WarmNode:
    """One SuperNode's Runtime API (``flower-supernode --isolation process --port``) and home."""

    address: str
    flwr_home: Path | None = None
    _next_poll: float = 0.0
    _interval: float = FAST_POLL
    _client: object | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, text: str) -> WarmNode:
        """``host:port`` or ``host:port=/flwr/home``."""
        address, _, home = text.partition("=")
        if not address or ":" not in address:
            raise ValueError(f"a node is host:port[=FLWR_HOME], got {text!r}")
        return cls(address.strip(), Path(home).resolve() if home else None)


class WarmExecutor:
    """Claims ClientApp tasks from SuperNodes' Runtime APIs and runs each in a forked child."""

    def __init__(self, nodes: Sequence[WarmNode], secret: bytes | None = None, *,
                 preload: Sequence[str] = PRELOAD, ledger: Path | None = None) -> None:
        """``ledger``: a JSON line per finished child (its node, lifetime, exact CPU-seconds and peak
        RSS from ``wait4``, how it ended), for benchmarks and operators."""
        if not nodes:
            raise ValueError("a warm executor needs at least one SuperNode")
        self.nodes = list(nodes)
        self.secret = secret
        self.preload = tuple(preload)
        self.ledger = ledger
        self.children: dict[int, tuple[WarmNode, float]] = {}
        self.launched = 0
        self.crashed = 0

    def warm_up(self, each: Callable[[str], None] | None = None) -> float:
        """Import everything a message needs and compile the codecs' kernels (where numba is there
        to compile them), once; the seconds it took. torch is held to one thread here: the parent must
        never start a thread pool that its forked children would inherit half-initialized (each child
        sets its own, ``threads_mod``). After each import the clean file pages it touched are handed
        back (``fedge.edge_client.page_release``): an idle parent that only forks holds its anonymous
        memory, and a child faults in the code it runs. ``each`` is called with every module's name
        once it is imported (a benchmark reads the process's memory there)."""
        started = time.perf_counter()
        release = os.environ.get(PAGE_RELEASE_ENV, "on") != "off"
        released = 0
        for name in self.preload:
            try:
                importlib.import_module(name)
            except ImportError as err:  # an optional accelerator of start-up, not a requirement
                log.info("not preloaded (each message imports it if it needs it): %s (%s)", name, err)
            if release:  # after each import, so the clean pages of all of them are never resident at once
                released += release_file_pages() or 0
            if each is not None:
                each(name)
        if release:
            log.info("released %.0f MiB of clean file pages after the imports (%s=off keeps them)",
                     released / 2**20, PAGE_RELEASE_ENV)
        import torch

        from fedge.compression import kernels
        from fedge.compression.warmup import warm_up

        torch.set_num_threads(1)
        if not kernels.available():  # nothing to compile: a warm-up would only touch pages a child may never use
            log.info("no codec kernels to warm here (numba missing or FEDGE_KERNELS=off): the torch reference path")
            return time.perf_counter() - started
        failed = warm_up()
        if failed:
            log.info("codec kernels not warmed (they compile on first use instead): %s", ", ".join(failed))
        if release:  # the compiler's own libraries, used once
            release_file_pages()
        return time.perf_counter() - started

    def _client(self, node: WarmNode):  # type: ignore[no-untyped-def]
        if node._client is None:
            from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
            from flwr.supercore.retry import make_simple_http_retry_invoker
            from flwr.supercore.runtime import RuntimeHttpClient

            interceptors: list[object] = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
            if self.secret:
                interceptors.append(SuperExecAuthHttpInterceptor(master_secret=self.secret,
                                                                 protected_methods={_ACQUIRE}))
            invoker = make_simple_http_retry_invoker()
            invoker.max_tries = 1  # a SuperNode that is not up yet is asked again at the next poll
            node._client = RuntimeHttpClient.from_server_address(
                server_address=node.address, insecure=True, root_certificates=None,
                interceptors=interceptors, retry_invoker=invoker)
        return node._client

    def poll(self, node: WarmNode) -> bool:
        """Ask ``node`` for one ClientApp task; fork a child for it. True when one was started."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore.constant import TaskType

        try:
            reply = self._client(node).AcquireTask(
                AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
        except Exception as err:  # noqa: BLE001 - the SuperNode restarts or is not up yet
            log.debug("SuperNode %s not reachable: %s", node.address, err)
            self._forget_client(node)
            return False
        if not (reply.HasField("task") and reply.token):
            return False
        self._fork(node, reply.token)
        return True

    def _forget_client(self, node: WarmNode) -> None:
        if node._client is not None:
            try:
                node._client.close()  # type: ignore[attr-defined]
            except Exception as err:  # noqa: BLE001 - a connection that will be made again anyway
                log.debug("closing the node's SuperExec client: %s", err)
            node._client = None

    def _fork(self, node: WarmNode, token: str) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _run_child(node, token, parent_pid=os.getppid())
        self.children[pid] = (node, time.time())
        self.launched += 1
        log.debug("message for %s runs in child %d", node.address, pid)

    def reap(self) -> None:
        """Collect finished children; a crashed one is logged and counted, nothing else changes."""
        while self.children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            node, started = self.children.pop(pid, (None, time.time()))
            how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"exit status {os.WEXITSTATUS(status)}")
            if how != "exit status 0":
                self.crashed += 1
                log.warning("the message in child %d (%s) ended with %s; the device carries on",
                            pid, node.address if node else "?", how)
            # a killed child (SIGKILL, a segfault) could not report its task: Flower's SuperNode
            # answers its message with a "ClientApp crashed" error once the task's heartbeat
            # expires, as it does for a killed flwr-clientapp process under subprocess isolation
            if self.ledger is not None:
                entry = {"event": "message", "pid": pid, "node": node.address if node else None,
                         "flwr_home": str(node.flwr_home) if node and node.flwr_home else None,
                         "start": started, "end": time.time(), "cpu_user": usage.ru_utime,
                         "cpu_system": usage.ru_stime, "max_rss_kib": usage.ru_maxrss, "ended": how}
                self.record(entry)

    def record(self, entry: dict[str, object]) -> None:
        """One line in the ledger (if any)."""
        if self.ledger is not None:
            with open(self.ledger, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")

    def serve(self, stop: threading.Event) -> None:
        """Poll every node until ``stop``; each node is asked again soon after a task, then less often."""
        while not stop.is_set():
            self.reap()
            now = time.monotonic()
            for node in self.nodes:
                if now < node._next_poll:
                    continue
                started = self.poll(node)
                node._interval = FAST_POLL if started else min(SLOW_POLL, node._interval * 1.5)
                node._next_poll = time.monotonic() + node._interval
            wake = min(node._next_poll for node in self.nodes)
            stop.wait(max(0.0, wake - time.monotonic()))
        self.close()

    def close(self, grace: float = 5.0) -> None:
        """Stop polling; children still running get ``grace`` seconds, then SIGTERM."""
        for node in self.nodes:
            self._forget_client(node)
        deadline = time.monotonic() + grace
        while self.children and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.reap()
        self.record({"event": "stopped", "pid": os.getpid(), "cpu": _own_cpu(), "messages": self.launched,
                     "ended_badly": self.crashed})


def _own_cpu() -> float:
    """This process's own user + system CPU (its children not included)."""
    times = os.times()
    return times.user + times.system


#: where a warm child notes, per FAB (by its SHA-256), the app directory Flower installed it to
INSTALLED_NOTES = ".fedge-installed-fabs"


def install_once(install: Callable[..., Path]) -> Callable[..., Path]:
    """Flower's ``install_from_fab`` as a warm child calls it: each FAB's bytes installed once.

    Flower's ClientApp runtime installs the run's FAB for every message: it extracts the whole
    archive into a temporary directory and checks every file's hash, then finds the app installed
    already (its directory is named by the FAB's SHA-256) and keeps nothing of that work. With
    Fedge's bundle (some 190 files) that was 0.15-0.2 CPU-s of every message on a device. Here the
    first install of a FAB's bytes is Flower's own, every check included; the directory it returns
    is then noted under the bytes' SHA-256 in the node's Flower home, and a later message with the
    same bytes gets that directory, while it exists, without extracting them again: what Flower
    itself returns once it finds the directory. Any other call is Flower's, unchanged."""

    @functools.wraps(install)
    def install_from_fab(fab_file: Path | bytes, install_dir: Path | None = None,
                         skip_prompt: bool = False) -> Path:
        home = os.environ.get("FLWR_HOME")
        if not isinstance(fab_file, bytes) or install_dir is not None or not skip_prompt or not home:
            return install(fab_file, install_dir, skip_prompt)
        note = Path(home) / INSTALLED_NOTES / hashlib.sha256(fab_file).hexdigest()
        try:
            installed = Path(note.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            installed = None
        if installed is not None and installed.is_dir():
            return installed
        installed = Path(install(fab_file, install_dir, skip_prompt))
        try:  # atomically: a message killed mid-write leaves no half a path for the next one
            note.parent.mkdir(parents=True, exist_ok=True)
            partial = note.with_name(f"{note.name}.{os.getpid()}.tmp")
            partial.write_text(str(installed), encoding="utf-8")
            os.replace(partial, note)
        except OSError as err:  # the next message installs again, as Flower would
            log.warning("could not note the installed app: %s", err)
        return installed

    return install_from_fab


def _run_child(node: WarmNode, token: str, *, parent_pid: int) -> None:
    """Run one message with Flower's own ClientApp runtime, then leave without running the
    parent's exit handlers (``os._exit``): the child owns nothing of the parent's to clean up."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if node.flwr_home is not None:
            os.environ["FLWR_HOME"] = str(node.flwr_home)
        import flwr.supernode.runtime.run_clientapp as runtime

        runtime.install_from_fab = install_once(runtime.install_from_fab)  # this child's runtime only
        # which ClientApp runs is the node's to decide: the FAB's, or its owner's installed one
        # (node config device-code = pinned; fedge.edge_client.device_code)
        from fedge.edge_client.device_code import load_client_app

        runtime.get_load_client_app_fn = lambda **_: load_client_app
        runtime.run_clientapp(runtime_api_address=node.address, token=token, insecure=True, certificates=None,
                              parent_pid=parent_pid, runtime_dependency_install=False)
        code = 0
    except SystemExit as done:  # Flower's flwr_exit: its exit handlers have pushed the outcome
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # report, never fall back into the parent's loop
        logging.getLogger("fedge.edge.warm").exception("the warm child failed")
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: the child exits all the same
                stream.flush()
        os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedge.edge_client.warm_executor", description=__doc__.split("\n")[0])
    parser.add_argument("--node", action="append", required=True, type=WarmNode.parse,
                        help="a SuperNode's Runtime API, host:port[=FLWR_HOME] (repeat for several)")
    parser.add_argument("--secret-file", type=Path, help="the SuperExec shared secret the SuperNodes were given")
    parser.add_argument("--parent-pid", type=int, help="exit when this process exits")
    parser.add_argument("--partitions", action="store_true",
                        help="nodes build their partition of a shared data set: import the partitioners too")
    parser.add_argument("--ledger", type=Path, help="append a JSON line per message run (CPU, peak RSS, lifetime)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    reason = warm_unavailable()
    if reason:
        log.error("warm execution cannot run here: %s", reason)
        return 2
    secret = args.secret_file.read_bytes() if args.secret_file else None
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    preload = PRELOAD + (PARTITION_PRELOAD if args.partitions else ())
    executor = WarmExecutor(args.node, secret, ledger=args.ledger, preload=preload)
    seconds = executor.warm_up()
    executor.record({"event": "ready", "pid": os.getpid(), "cpu": _own_cpu(), "seconds": seconds,
                     "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
    log.info("warm: %d module(s) imported in %.2f s; serving %d SuperNode(s)", len(executor.preload), seconds,
             len(executor.nodes))
    if args.parent_pid:
        _exit_with(args.parent_pid, stop)
    executor.serve(stop)
    log.info("warm executor stopped: %d message(s) run, %d ended badly", executor.launched, executor.crashed)
    return 0


def _exit_with(parent_pid: int, stop: threading.Event) -> None:
    """Stop when ``parent_pid`` is gone. Polled from the serve loop's thread, not a thread of its own:
    the parent forks, and stays single-threaded for it."""

    def check(signum: int, frame: object) -> None:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            stop.set()

    signal.signal(signal.SIGALRM, check)
    signal.setitimer(signal.ITIMER_REAL, 1.0, 1.0)


if __name__ == "__main__":
    raise SystemExit(main())
