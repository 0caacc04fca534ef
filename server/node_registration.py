"""``python -m fedge.server.node_registration CONNECTION KEY NAME [KEY NAME ...]``: Flower's own
``flwr supernode register KEY CONNECTION --format json [--name NAME]`` for every key, in one process.

Each ``flwr`` process spends about 1.4 CPU-s importing Flower's CLI before it sends one request, so
a launch that registers its devices one ``flwr`` process each waits that long per device: 6.6 s for
four keys on a 2-core EPYC, against 1.7 s for the same four here (2026-12-03). The command line is
the same one ``flwr`` parses (its entry point, ``flwr.cli.app:app``), so what Flower checks and
answers is unchanged: one JSON reply per key on stdout, as ``flwr`` prints it (a key Flower refuses
gets Flower's own JSON error and the next key is tried); the status is 1 when any key failed.
"""

from __future__ import annotations

import json
import sys

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Register each (key, name) pair of ``argv[1:]`` with the SuperLink connection ``argv[0]``
    (an empty name: none); 0 when every key was registered, else 1."""
    from flwr.cli.app import app  # Flower's `flwr` command itself

    connection, pairs, failed = argv[0], argv[1:], False
    for key, name in zip(pairs[::2], pairs[1::2]):
        try:  # Flower prints the key's JSON reply, its error included (then returns its exit code)
            named = ["--name", name] if name else []
            code = app(["supernode", "register", key, connection, "--format", "json", *named], standalone_mode=False)
        except Exception as err:  # noqa: BLE001 - what Flower did not answer itself, in its reply's shape
            print(json.dumps({"success": False, "error-message": f"{type(err).__name__}: {err}"}), flush=True)
            code = 1
        failed = failed or bool(code)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
