"""The product as an operator runs it: ``fedge serve`` (TLS, SuperNode authentication, state database,
/metrics) and devices joining with their own ``.npz`` data through ``fedge-edge join``, all real
processes on 127.0.0.1. One run covers the acceptance path and the short chaos drill: 4 rounds over
TLS; /metrics scraped and parsed with prometheus_client's own parser while counters move (rounds,
replies, a faulty device's rejections); SIGTERM to the daemon stops at a round boundary with a valid
checkpoint and exit 0; after a restart and one more round, a power cut of the whole coordinator and
of one device in three (SIGKILL); the coordinator restarts, the device rejoins with its saved
state, and the run finishes with every round exactly once; every process is gone afterwards. The
full chaos benchmark (30% of 10 SuperNodes, undisturbed baseline side by side): ``bench/chaos.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedge.deploy.certs import init_ca, issue_server_certificate, make_node_key
from fedge.server.run.checkpoint import CheckpointStore
from fedge.launcher.environment import flower_environment
from fedge.launcher.federation import supernode_argv
from fedge.launcher.isolation import supernode_isolation_argv, warm_executor_argv, write_secret
from fedge.launcher.processes import ProcessGroup, free_port, processes_with_env
from fedge.tasks import make_task
from tests.integration.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BIN = Path(sys.executable).parent


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def _checkpoint_round(run_dir: Path) -> int:
    checkpoint = CheckpointStore(run_dir / "checkpoint").load()
    return checkpoint.round if checkpoint is not None else 0


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "ab") as handle:
        return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def test_daemon_and_joined_devices_train_over_tls_stop_on_sigterm_and_resume(tmp_path: Path, assert_no_leftovers) -> None:
    certs = tmp_path / "certs"
    init_ca(certs)
    issue_server_certificate(certs, ["127.0.0.1", "localhost"])
    task = make_task("digits")
    for i in range(3):
        make_node_key(certs, f"device-{i}")
        part = task.partition(i, 3, "iid")  # stands in for each device's own data
        np.savez(tmp_path / f"device-{i}.npz", x=part.x.numpy(), y=part.y.numpy())
    port, metrics_port, page_port = free_port(), free_port(), free_port()
    (tmp_path / "fedge.toml").write_text(f"""
[service]
address = "127.0.0.1:{port}"
state-dir = "state"
metrics-address = "127.0.0.1:{metrics_port}"
page-address = "127.0.0.1:{page_port}"
tls-ca = "certs/ca.crt"
tls-cert = "certs/server.crt"
tls-key = "certs/server.key"
register-keys = ["certs/device-0.pub", "certs/device-1.pub", "certs/device-2.pub"]
node-poll-seconds = 15
stop-grace-seconds = 240

[run]
rounds = 4
clients-per-round = 3
min-replies = 2
local-epochs = 5
wait-for-nodes = 240
round-timeout = 240
""")
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    serve = [str(BIN / "fedge"), "serve", "--config", str(tmp_path / "fedge.toml")]
    run_dir, state = tmp_path / "state" / "run", tmp_path / "state"
    devices: list[subprocess.Popen] = []
    passed = False  # a failed run still must not leave processes behind (swept in `finally`)
    daemon = _start(serve, tmp_path / "serve-1.log", env)
    try:
        wait_for(lambda: "run submitted" in (tmp_path / "serve-1.log").read_text(), 120, "the daemon to submit the run")
        def join(i: int) -> list[str]:
            # --no-default-policy: these devices' identities are issued, so by default they would
            # refuse this run's rounds in clear (tests/edge_client/test_join_check.py); the daemon is
            # what is tested here
            return [str(BIN / "fedge-edge"), "join", "--superlink", f"127.0.0.1:{port}", "--root-cert",
                    str(certs / "ca.crt"), "--auth-key", str(certs / f"device-{i}"), "--data",
                    str(tmp_path / f"device-{i}.npz"), "--state-dir", str(tmp_path / f"device-{i}"),
                    "--no-default-policy"]

        for i in range(2):
            devices.append(_start(join(i), tmp_path / f"join-{i}.log", env))
        # the third device corrupts every update (Fedge's fault mod through its node config): a real
        # SuperNode, registered, whose replies the coordinator must reject and count. Its messages
        # run warm, as `fedge-edge join` runs them (one import of torch, not one per message).
        faulty_home = tmp_path / "device-2" / "flwr-home"
        secret = write_secret(tmp_path / "device-2" / "superexec.secret")
        with ProcessGroup(tmp_path / "device-2" / "logs", env=flower_environment(faulty_home)) as faulty:
            runtime_port = free_port()
            faulty.start("supernode", supernode_argv(
                f"127.0.0.1:{port}", runtime_port,
                f'data="{tmp_path / "device-2.npz"}" fault="truncate" state-dir="{tmp_path / "device-2"}"',
                root_cert=certs / "ca.crt", auth_key=certs / "device-2",
                extra=supernode_isolation_argv("warm", secret)))
            faulty.start("warm-executor", warm_executor_argv([(f"127.0.0.1:{runtime_port}", faulty_home)], secret))
            wait_for(lambda: _scrape(metrics_port)["fedge_rounds_completed_total"] >= 1, 300, "round 1 on /metrics")
            first = _scrape(metrics_port)
            # the live page's data: the run's rows, and the devices with the SuperLink's own status
            page = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{page_port}/api/federation", timeout=10).read())
            assert page["rows"] and page["online_known"] and page["settings"]["rounds"] == 4
            assert sum(d.get("status") == "online" for d in page["devices"]) >= 2, page["devices"]
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=300) == 0, (tmp_path / "serve-1.log").read_text()[-3000:]
            stopped_at = CheckpointStore(run_dir / "checkpoint").load()
            assert stopped_at is not None and 1 <= stopped_at.round < 3  # valid, loadable, at a round boundary
            assert [r["round"] for r in _rows(run_dir)] == list(range(1, stopped_at.round + 1))
            assert first["fedge_rounds_completed_total"] >= 1 and first["fedge_replies_used_total"] >= 2
            assert first["fedge_uplink_bytes_total"] > 0 and first["fedge_superlink_up"] == 1
            assert first["fedge_replies_rejected_total{kind=invalid}"] >= 1  # the truncating device
            events = [json.loads(line) for line in (tmp_path / "serve-1.log").read_text().splitlines()
                      if line.startswith("{")]
            assert any(e["event"] == "reply rejected" and "node" in e and e.get("round") == 1 for e in events)
            # the node poll asks the TLS SuperLink through the daemon's one flwr process, and is answered
            assert any(e["event"] == "nodes online" for e in events)
            assert not any(e["event"] == "could not list nodes" for e in events)
            run_id = json.loads((run_dir / "config.json").read_text())["flower_run_id"]
            assert all(e.get("run") == run_id for e in events if e["event"] in ("round completed", "reply rejected"))

            # Chaos: the restarted daemon runs a round, then the coordinator loses power (daemon,
            # SuperLink, ServerApp, flwr run: SIGKILL) and so does device 1 (join and SuperNode).
            daemon = _start(serve, tmp_path / "serve-2.log", env)  # the devices reconnect by themselves
            # Wait for the checkpoint, not the row: the engine writes a round's row, then its checkpoint,
            # and a cut between the two leaves a row that the resumed run drops and runs again.
            wait_for(lambda: _checkpoint_round(run_dir) > stopped_at.round or daemon.poll() is not None, 300,
                      "a round checkpointed after the restart")
            for pid in [daemon.pid, devices[1].pid, *processes_with_env("FLWR_HOME", str(state / "flwr-home")),
                        *processes_with_env("FLWR_HOME", str(tmp_path / "device-1" / "flwr-home"))]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            daemon.wait(), devices[1].wait()
            cut_at = CheckpointStore(run_dir / "checkpoint").load()  # loadable right after a power cut
            assert cut_at is not None and cut_at.round > stopped_at.round
            assert [r["round"] for r in _rows(run_dir)][: cut_at.round] == list(range(1, cut_at.round + 1))

            daemon = _start(serve, tmp_path / "serve-3.log", env)  # finds and stops nothing: all was killed
            devices[1] = _start(join(1), tmp_path / "join-1b.log", env)  # the device comes back
            scrapes = []
            while daemon.poll() is None:
                try:
                    scrapes.append(_scrape(metrics_port))
                except OSError:
                    pass
                time.sleep(2)
            assert daemon.returncode == 0, (tmp_path / "serve-3.log").read_text()[-3000:]
        rows = _rows(run_dir)
        assert [r["round"] for r in rows] == [1, 2, 3, 4]  # every round exactly once, every line parsed
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["rounds"] == 4 and summary["final_accuracy"] > 0.8
        assert summary["resumed_from_round"] == cut_at.round
        assert scrapes and max(s["fedge_current_round"] for s in scrapes) == 4
        assert (tmp_path / "device-0" / "node-state.npz").exists()  # error feedback kept on the device's disk
        for device in devices:
            device.send_signal(signal.SIGTERM)
            assert device.wait(timeout=60) == 0
        passed = True
    finally:  # on failure too: SIGTERM lets the daemon and join stop what they started, then SIGKILL
        for process in [daemon, *devices]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [daemon, *devices]:
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        homes = [state / "flwr-home", *(tmp_path / f"device-{i}" / "flwr-home" for i in range(3))]
        for pid in () if passed else (pid for home in homes for pid in processes_with_env("FLWR_HOME", str(home))):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert_no_leftovers(state / "flwr-home")
    for i in range(3):
        assert_no_leftovers(tmp_path / f"device-{i}" / "flwr-home")
