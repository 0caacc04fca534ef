"""``python -m fedge.server.flower_cli``: Flower's own ``flwr`` command, run again and again in one
long-lived process (the other side: :class:`fedge.launcher.flower_cli.FlowerCli`).

Each ``flwr`` process spends about 1.4 CPU-s importing Flower's CLI before it sends one request. A
launch registered its devices one ``flwr`` process each (6.6 s for four keys on a 2-core EPYC,
2026-12-03), and ``fedge serve`` asked ``flwr supernode ls`` every ``node-poll-seconds`` and ``flwr
ls`` every 5 s once a run's log stream ended, a process each, for as long as it served. Here the
imports are paid once. Each request is one line on stdin, a JSON list: the arguments ``flwr`` would
get, passed to its own entry point (``flwr.cli.app:app``), so what Flower checks and answers is
unchanged. Whatever Flower prints for it (a ``--format json`` reply: on ``sys.__stdout__``) is
followed by one line, ``END`` (``fedge.launcher.flower_cli``) and the exit code. The process ends
when stdin closes (the caller stopped it, or died).

Flower redirects ``sys.stdout`` process-wide while a JSON command runs, which is why this runs in a
process of its own rather than inside the daemon, whose other threads log.
"""

from __future__ import annotations

import json
import sys

from fedge.launcher.flower_cli import END

__all__ = ["main"]


def _run(app: object, argv: list[str]) -> int:
    """``flwr ARGV``'s exit code. Flower prints its own errors (in JSON under ``--format json``); a
    usage error goes to stderr with click's code, as ``flwr`` shows it; anything else is printed in
    the shape of Flower's JSON reply."""
    try:
        return int(app(argv, standalone_mode=False) or 0)  # type: ignore[operator]
    except SystemExit as stop:  # click's own exits, e.g. a usage error
        return 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    except Exception as err:  # noqa: BLE001 - one bad request must not end the process
        if callable(getattr(err, "show", None)) and isinstance(getattr(err, "exit_code", None), int):
            err.show(file=sys.__stderr__)  # type: ignore[attr-defined]  # a usage error, as `flwr` shows it
            return int(err.exit_code)  # type: ignore[attr-defined]
        print(json.dumps({"success": False, "error-message": f"{type(err).__name__}: {err}"}),
              file=sys.__stdout__, flush=True)
        return 1


def main() -> int:
    from flwr.cli.app import app  # Flower's `flwr` command itself

    out = sys.__stdout__
    assert out is not None
    for line in sys.stdin:
        try:
            argv = json.loads(line)
            code = _run(app, [str(a) for a in argv]) if isinstance(argv, list) else 2
        except json.JSONDecodeError:
            code = 2
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # what a failed JSON command left redirected
        out.write(f"\n{END}{code}\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
