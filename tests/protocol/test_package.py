"""``fedge.protocol``'s names are ``records``'s, imported on first use: a command that only parses
its arguments (``fedge --help``, ``fedge settings``) does not import torch."""

from __future__ import annotations

import subprocess
import sys

import fedge.protocol
from fedge.protocol import records


def test_the_package_names_are_the_records_names() -> None:
    assert fedge.protocol.__all__ == records.__all__
    assert all(getattr(fedge.protocol, name) is getattr(records, name) for name in records.__all__)


def test_the_cli_and_a_light_submodule_import_without_torch() -> None:
    code = ("import sys, fedge.server.cli.main, fedge.protocol.plugins; "
            "print(sorted(m for m in ('torch', 'flwr', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
