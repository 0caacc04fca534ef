"""Registering SuperNode keys in one process (``fedge.launcher.flower_cli``), where Flower
refuses them before any SuperLink answers: each key gets Flower's own JSON reply, and the first
refused one raises with Flower's answer and the key's path. A SuperLink that registers them is
``tests/integration/test_tls.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedge.deploy.certs import make_node_key
from fedge.launcher.environment import flower_environment
from fedge.launcher.federation import RegistrationError, register_nodes, write_connection


def test_a_refused_key_raises_with_flowers_answer_and_no_key_starts_no_process(tmp_path: Path) -> None:
    home = tmp_path / "flwr-home"
    env = flower_environment(home)
    make_node_key(tmp_path, "node-0")
    write_connection(home, "fedge", "127.0.0.1:9", None)  # nothing listens on port 9
    keys = [(tmp_path / "node-0.pub", "node-0"), (tmp_path / "node-0.pub", None)]
    with pytest.raises(RegistrationError, match=r"node-0\.pub failed: .*'nosuch' not found"):
        register_nodes(keys, "nosuch", env, timeout=30)
    with pytest.raises(RegistrationError, match=r"(?s)node-0\.pub failed: .*SuperLink is unavailable"):
        register_nodes(keys, "fedge", env, timeout=30, registered_ok=True)  # not "already in use": raised
    assert register_nodes([], "nosuch", env) == []  # no key: nothing to run
