"""How a SuperNode runs its messages: ``warm`` (Fedge's default) or Flower's ``subprocess``.

``subprocess``: ``flower-supernode`` starts Flower's SuperExec, which launches a new
``flwr-clientapp`` process per message (imports Python, torch, Flower and Fedge each time).
``warm``: ``flower-supernode --isolation process`` starts nothing; one warm process
(:mod:`fedge.edge_client.warm_executor`) claims each message's task from the SuperNode's Runtime API
with the SuperExec shared secret and runs it in a child forked from its pre-imported parent. A local
cluster shares one warm parent across all its SuperNodes.

Where warm execution cannot run (:func:`warm_unavailable`), the choice falls back to ``subprocess`` with the reason logged.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from fedge.launcher.processes import module_argv

__all__ = ["ISOLATIONS", "choose_isolation", "supernode_isolation_argv", "warm_executor_argv", "warm_unavailable", "write_secret"]

log = logging.getLogger(__name__)

ISOLATIONS = ("warm", "subprocess")


def warm_unavailable() -> str | None:
    """Why warm execution cannot run here (the caller falls back to subprocess isolation), or None."""
    if not hasattr(os, "fork"):
        return "os.fork is not available on this platform"
    if sys.platform == "darwin":
        return "fork() after importing torch is unsafe on macOS (its Objective-C runtime)"
    for module in ("flwr.supercore.runtime", "flwr.supernode.runtime.run_clientapp"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"this Flower has no {module} (the Runtime API a warm process claims tasks from)"
    return None


def choose_isolation(requested: str) -> str:
    """``requested`` if it can run here; ``warm`` falls back to ``subprocess`` with a logged reason."""
    if requested not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {requested!r}")
    if requested == "warm":
        reason = warm_unavailable()
        if reason:
            log.warning("warm execution is not available (%s): each message starts its own "
                        "flwr-clientapp process (subprocess isolation)", reason)
            return "subprocess"
    return requested


def write_secret(path: Path) -> Path:
    """The SuperExec shared secret (32 random bytes, owner-only) a warm process proves itself with:
    no other local user can claim this device's messages from its Runtime API."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(32))
    return path


def supernode_isolation_argv(isolation: str, secret: Path | None) -> list[str]:
    """Flags for ``flower-supernode``: nothing for subprocess; process isolation and the secret for warm."""
    if isolation == "subprocess":
        return []
    if secret is None:
        raise ValueError("warm isolation needs the SuperExec secret file")
    return ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]


def warm_executor_argv(nodes: Sequence[tuple[str, Path | None]], secret: Path,
                       parent_pid: int | None = None, ledger: Path | None = None,
                       partitions: bool = False) -> list[str]:
    """The warm process serving ``nodes`` (Runtime API ``host:port``, the node's FLWR_HOME);
    ``ledger``: where it appends a JSON line per message it ran; ``partitions``: the nodes build
    their partition of a shared data set (import the partitioners once too)."""
    argv = [*module_argv("fedge.edge_client.warm_executor"), "--secret-file", str(secret)]
    if partitions:
        argv.append("--partitions")
    if ledger is not None:
        argv += ["--ledger", str(ledger)]
    for address, home in nodes:
        argv += ["--node", f"{address}={home}" if home else address]
    if parent_pid is not None:
        argv += ["--parent-pid", str(parent_pid)]
    return argv
