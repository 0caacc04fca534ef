"""Device trust on real processes (privacy audit 3, F1 and F2): a SuperLink, three SuperNodes pinned
to their installed ClientApp (node config ``device-code = "pinned"``, as ``fedge-edge join`` sets it),
the warm executor, and a coordinator that lies. Its ServerApp (``liar``, shipped in the run's FAB
with a plugin module of its own) sends every device a gossip message marked as masked, a plain train
message that names its plugin, and one without secure aggregation; a second run's FAB names the coordinator's own ClientApp.
Every device answers each with a typed ``policy`` refusal and nothing else: no update, no example
count, no metric; neither the shipped plugin nor the shipped ClientApp ever runs on a device."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

from fedge.launcher.environment import flower_environment
from fedge.launcher.processes import ProcessGroup
from fedge.launcher.sequence import FlowerLaunch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

_SERVER = '''
"""A coordinator that may lie: it asks each device for what its policy forbids."""
import json
import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    deadline = time.monotonic() + 120
    while len(grid.get_node_ids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    asks = {
        "gossip-marked-masked": ("train.gossip", {"config": ConfigRecord({"task": "digits", "round": 1}),
                                                   "secagg": ConfigRecord({"stage": "masked", "round": 1})}),
        "train-naming-a-plugin": ("train", {"config": ConfigRecord({"task": "digits", "round": 1,
                                                                     "plugins": "planted"})}),
        "train-in-clear": ("train", {"config": ConfigRecord({"task": "digits", "round": 1})}),
    }
    replies = {}
    for name, (message_type, records) in asks.items():
        sent = [Message(RecordDict(dict(records)), dst_node_id=node, message_type=message_type)
                for node in grid.get_node_ids()]
        answers = list(grid.send_and_receive(sent, timeout=120))
        replies[name] = [{"records": sorted(a.content.keys()) if a.has_content() else [],
                          "refusal": dict(a.content.config_records["refusal"]) if a.has_content()
                          and "refusal" in a.content else None,
                          "error": a.error.reason if a.has_error() else None} for a in answers]
    with open(str(context.run_config["results"]), "w", encoding="utf-8") as handle:
        json.dump(replies, handle)
'''

_PLANTED = '''
import os
import sys

if "fedge.server" not in sys.modules:  # on a device: the attack ran
    open(os.environ.get("FEDGE_PLANTED_MARKER", "/dev/null"), "a").write("planted\\n")
'''

_CLIENT = '''
import os

from flwr.clientapp import ClientApp

open(os.environ.get("FEDGE_PLANTED_MARKER", "/dev/null"), "a").write("client app\\n")
app = ClientApp()
'''


def _app(root: Path, client_app: str) -> Path:
    """The liar's app directory: its ServerApp, a plugin module and a ClientApp of its own, all
    shipped in the FAB; ``client_app`` names the one the FAB asks devices to run."""
    root.mkdir(parents=True)
    (root / "liar").mkdir()
    (root / "liar" / "__init__.py").write_text("")
    (root / "liar" / "server_app.py").write_text(_SERVER)
    (root / "liar" / "client_app.py").write_text(_CLIENT)
    (root / "planted.py").write_text(_PLANTED)
    (root / "pyproject.toml").write_text(textwrap.dedent(f'''\
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "liar"
        version = "1.0.0"
        dependencies = []

        [tool.hatch.build.targets.wheel]
        packages = ["."]

        [tool.flwr.app]
        publisher = "liar"

        [tool.flwr.app.components]
        serverapp = "liar.server_app:app"
        clientapp = "{client_app}"

        [tool.flwr.app.config]
        results = ""
        '''))
    return root


def _runs(tmp_path: Path, apps: dict[str, Path]) -> dict[str, dict]:
    """Each app run in turn on one federation; every device's replies, by app and ask."""
    home = tmp_path / "flwr-home"
    pinned = {"device-code": "pinned"}
    policy = {**pinned, "require-secure-aggregation": "true", "min-participants": 3, "min-threshold": 0.66}
    out = {}
    with ProcessGroup(tmp_path / "logs", env=flower_environment(home), also_match={"FLWR_HOME": str(home)}) as group:
        flower = FlowerLaunch(group, home, isolation="warm")
        flower.start_superlink(cwd=tmp_path)
        for i, config in enumerate((policy, policy, pinned)):
            flower.start_supernode(i, {"partition-id": i, "num-partitions": 3, **config}, cwd=tmp_path)
        flower.start_warm_executor(cwd=tmp_path)
        for name, app in apps.items():
            results = tmp_path / f"{name}.json"
            runner = flower.submit(app, {"results": str(results)}, cwd=tmp_path)
            flower.follow(runner, time.monotonic() + 300)
            assert runner.popen.returncode == 0, runner.log_tail(40)
            group.processes.remove(runner)  # done: the next run's follow() watches the others
            out[name] = json.loads(results.read_text())
    return out


def test_a_lying_coordinator_gets_only_typed_refusals_from_pinned_devices(tmp_path: Path, monkeypatch) -> None:
    marker = tmp_path / "planted-ran"
    monkeypatch.setenv("FEDGE_PLANTED_MARKER", str(marker))
    runs = _runs(tmp_path, {"fedge-client": _app(tmp_path / "fedge-client", "fedge.edge_client.app:app"),
                            "own-client": _app(tmp_path / "own-client", "liar.client_app:app")})
    fedge_client = runs["fedge-client"]
    for name, replies in fedge_client.items():
        assert len(replies) == 3, (name, replies)
        # a refusal record (and the resource report) or an error: no update, example count or metric
        assert all(set(reply["records"]) <= {"refusal", "resources"} for reply in replies), (name, replies)
    gossip = fedge_client["gossip-marked-masked"]
    policy = [r["refusal"]["reason"] for r in gossip if r["refusal"] is not None]
    # the two devices with the policy refuse the action, whatever record it carries; the third has no
    # policy, and its gossip handler fails on the liar's config before it trains or sends anything
    assert len(policy) == 2 and all("does not run inside secure aggregation" in reason for reason in policy), gossip
    plugin = fedge_client["train-naming-a-plugin"]
    assert all(r["refusal"] is not None and r["refusal"]["kind"] == "policy" for r in plugin), plugin
    # the warm executor checks the modules a message names before any app runs: all three refuse it
    assert all("plugin module 'planted'" in r["refusal"]["reason"] for r in plugin), plugin
    clear = fedge_client["train-in-clear"]  # audit 2, N1: a round without secure aggregation
    refused = [r["refusal"]["reason"] for r in clear if r["refusal"] is not None]
    assert len(refused) == 2 and all("the round has none" in reason for reason in refused), clear
    for replies in runs["own-client"].values():
        for reply in replies:
            assert reply["refusal"]["kind"] == "policy" and "'liar.client_app:app'" in reply["refusal"]["reason"]
            assert set(reply["records"]) <= {"refusal", "resources"}
    assert not marker.exists(), marker.read_text()  # neither the plugin nor the ClientApp ran on a device
