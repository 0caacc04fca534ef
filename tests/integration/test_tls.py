"""TLS and SuperNode authentication with real Flower processes on 127.0.0.1 (certificates from
``deploy/certs.py``): an unregistered key is refused, a plaintext node never connects, a registered one
joins. That a registered node also trains over TLS is tested with FedBuff in
``test_deployment_engine.py`` (which runs with ``tls=True``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedge.deploy.certs import make_node_key
from fedge.launcher.environment import flower_environment
from fedge.launcher.federation import (
    EXIT_NODE_REFUSED,
    LoopbackSecurity,
    RegistrationError,
    register_node,
    register_nodes,
    superlink_argv,
    supernode_argv,
    write_connection,
)
from fedge.launcher.processes import ProcessGroup, free_port, wait_for_port
from tests.integration.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_unregistered_and_plaintext_supernodes_are_refused(tmp_path: Path, assert_no_leftovers) -> None:
    home = tmp_path / "flwr-home"
    env = flower_environment(home)
    security = LoopbackSecurity.create(tmp_path / "tls", nodes=3)
    make_node_key(security.directory, "rogue")  # a well-formed key nobody registered
    port = free_port()
    address = f"127.0.0.1:{port}"
    write_connection(home, "fedge", address, security.server.ca_cert)
    config = "partition-id=0 num-partitions=1"
    with ProcessGroup(tmp_path / "logs", env=env, also_match={"FLWR_HOME": str(home)}) as group:
        superlink = group.start("superlink", superlink_argv("127.0.0.1", port, security.server), cwd=tmp_path)
        wait_for_port(port, 60, superlink)
        # registered through the operator's command (which runs Flower's `flwr supernode register`)
        done = subprocess.run([str(Path(sys.executable).parent / "fedge"), "certs", "register",
                               str(security.directory / "node-0.pub"), "--superlink", address,
                               "--root-cert", str(security.server.ca_cert)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        node_id = int(done.stdout.split(" as node ")[1])
        with pytest.raises(RegistrationError, match="already in use"):
            register_node(security.directory / "node-0.pub", "fedge", env)
        # a launch registers its keys in one process, each answered by Flower in order; a daemon
        # restarted on its database keeps the keys registered before
        keys = [(security.directory / f"node-{i}.pub", name) for i, name in ((1, "node-1"), (0, None), (2, None))]
        first, again, last = register_nodes(keys, "fedge", env, registered_ok=True)
        assert again is None and None not in (first, last) and len({first, last, node_id}) == 3
        with pytest.raises(RegistrationError, match="(?s)node-1.pub failed: .*already in use"):
            register_nodes(keys[:1], "fedge", env)
        good = group.start("good", supernode_argv(address, free_port(), config, root_cert=security.server.ca_cert,
                                                  auth_key=security.node_key(0)), cwd=tmp_path)
        rogue = group.start("rogue", supernode_argv(address, free_port(), config, root_cert=security.server.ca_cert,
                                                    auth_key=security.directory / "rogue"), cwd=tmp_path)
        plain = group.start("plain", supernode_argv(address, free_port(), config), cwd=tmp_path)

        wait_for(lambda: not rogue.alive(), 90, "the unregistered SuperNode to be refused")
        # flwr_exit logs Flower's code (305: SuperNode refused); the process itself exits 1
        assert rogue.popen.returncode != 0 and f"Exit Code: {EXIT_NODE_REFUSED}" in rogue.log_path.read_text()
        wait_for(lambda: f"SuperNode ID: {node_id}" in good.log_path.read_text(), 90,
                  "the registered SuperNode to connect")
        # The plaintext node has had as long as both of them, and is still knocking on a TLS port.
        assert "Connection attempt failed" in plain.log_path.read_text()
        assert "SuperNode ID" not in plain.log_path.read_text() and plain.alive()
        assert superlink.alive()
    assert_no_leftovers(home)
