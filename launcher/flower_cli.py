"""Flower's ``flwr`` command without a process per call: one helper process
(``python -m fedge.server.flower_cli``) answers every call, in order.

A ``flwr`` process spends about 1.4 CPU-s on Flower's imports before its one request; a launch that
registers keys and a daemon that polls the SuperLink for as long as it serves paid that at every
call. :class:`FlowerCli` starts the helper on its first call and keeps it. The helper runs Flower's
CLI, which this layer never imports: this side only writes its requests and reads its answers.

A call that takes longer than its timeout, or a helper that died, ends the helper: the call raises
:class:`FlowerCliError`, and the next one starts a fresh helper, so one hung request never holds
the later ones. Calls from several threads are answered one at a time.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from fedge.launcher.processes import module_argv

__all__ = ["END", "FlowerCli", "FlowerCliError", "json_replies"]

#: starts the line the helper writes after each answer; the rest of the line is the exit code
END = "\x1efedge-flwr-end "


class FlowerCliError(RuntimeError):
    """The helper gave no answer: it timed out, could not start, or died (its stderr's tail says why)."""


def json_replies(text: str) -> list[Any]:
    """Every JSON value in ``text``, in order (what ``flwr ... --format json`` printed)."""
    replies, decoder, text = [], json.JSONDecoder(), text.strip()
    while text:
        try:
            reply, end = decoder.raw_decode(text)
        except json.JSONDecodeError:
            break
        replies.append(reply)
        text = text[end:].lstrip()
    return replies


class FlowerCli:
    """``flwr ARGS`` in one long-lived process. ``env`` is the environment the helper runs in (its
    ``FLWR_HOME`` names the connections); ``cwd`` its working directory, for relative paths in ``ARGS``
    only: the helper runs without it on its import path (:func:`fedge.launcher.processes.module_argv`),
    so a module planted there, next to a key, never runs."""

    def __init__(self, env: Mapping[str, str], cwd: Path) -> None:
        home = env.get("FLWR_HOME")
        self.env = {**env, **({"FLWR_HOME": str(Path(home).resolve())} if home else {})}
        self.cwd = Path(cwd).resolve()
        self._lock = threading.Lock()
        self._popen: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: Any = None

    @property
    def pid(self) -> int | None:
        """The helper's process id, while one runs."""
        return self._popen.pid if self._popen is not None and self._popen.poll() is None else None

    def call(self, args: list[str], timeout: float = 60.0) -> tuple[int, str]:
        """``(exit code, what flwr printed)`` for ``flwr ARGS``; raises :class:`FlowerCliError` when the
        helper gives no answer within ``timeout`` seconds (it is then stopped)."""
        with self._lock:
            popen = self._start()
            try:
                assert popen.stdin is not None
                popen.stdin.write(json.dumps([str(a) for a in args]) + "\n")
                popen.stdin.flush()
            except OSError as err:
                tail = self._tail()
                self._stop(kill=True)
                raise FlowerCliError(f"flwr {' '.join(args[:2])}: the helper is gone ({err}){tail}") from None
            output: list[str] = []
            deadline = time.monotonic() + timeout
            while True:
                try:
                    line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    self._stop(kill=True)
                    raise FlowerCliError(f"flwr {' '.join(args[:2])}: no answer within {timeout:g} s") from None
                if line is None:
                    tail = self._tail()
                    self._stop(kill=True)
                    raise FlowerCliError(f"flwr {' '.join(args[:2])}: the helper exited{tail}")
                if line.startswith(END):
                    return int(line[len(END):].strip() or 1), "".join(output)
                output.append(line)

    def close(self) -> None:
        """Stop the helper (a later call starts another)."""
        with self._lock:
            self._stop()

    def __enter__(self) -> FlowerCli:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> subprocess.Popen[str]:
        if self._popen is not None and self._popen.poll() is None:
            return self._popen
        self._stop()
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8")
        try:
            popen = subprocess.Popen(module_argv("fedge.server.flower_cli"), env=self.env, cwd=self.cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                     encoding="utf-8", bufsize=1)
        except OSError as err:
            raise FlowerCliError(f"cannot start the flwr helper: {err}") from None
        self._popen, self._lines = popen, queue.Queue()
        threading.Thread(target=_pump, args=(popen, self._lines), name="fedge-flwr-reader", daemon=True).start()
        return popen

    def _stop(self, kill: bool = False) -> None:
        """End the helper: at the end of its input, or at once (``kill``: a request that hangs)."""
        popen, self._popen = self._popen, None
        if popen is not None:
            if not kill:
                try:
                    if popen.stdin is not None:
                        popen.stdin.close()
                    popen.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    kill = True
            if kill:
                popen.kill()
                popen.wait()
                if popen.stdin is not None:
                    with contextlib.suppress(OSError):  # its reader is gone: a pending write cannot flush
                        popen.stdin.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def _tail(self) -> str:
        """The helper's stderr's last lines, for an error message."""
        if self._stderr is None:
            return ""
        try:
            self._stderr.flush()
            self._stderr.seek(0)
            text = self._stderr.read().strip()
        except (OSError, ValueError):
            return ""
        return f": {text[-800:]}" if text else ""


def _pump(popen: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    """Every line the helper prints, then None when its output ends."""
    assert popen.stdout is not None
    try:
        for line in popen.stdout:
            lines.put(line)
    except (OSError, ValueError):
        pass
    lines.put(None)

