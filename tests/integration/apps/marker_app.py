"""A minimal Flower app (ServerApp + ClientApp, Message API) written out with a marker, so two
builds share one package name and differ only in their code: what a warm device must keep apart.

Each ClientApp message counts how many messages its process has handled (a module global) and
replies with the marker, that count and its pid; with ``crash=1`` the first message's process
kills itself (SIGKILL, as an out-of-memory kill or a segfault would). The ServerApp sends
``messages`` rounds of one message per node and writes every reply (or ``null``) to ``out``.
"""

from __future__ import annotations

from pathlib import Path

_PYPROJECT = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "markerapp"
version = "1.0.0"
dependencies = []

[tool.flwr.app]
publisher = "fedge-tests"

[tool.flwr.app.components]
serverapp = "markerapp.server_app:app"
clientapp = "markerapp.client_app:app"

[tool.flwr.app.config]
out = ""
messages = 2
crash = 0
timeout = 150
crash-timeout = 150
"""

_CLIENT = '''import os
import signal

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

MARKER = "{marker}"
HANDLED = 0

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    global HANDLED
    HANDLED += 1
    if int(msg.content["config"]["crash"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return Message(RecordDict({{"reply": ConfigRecord({{"marker": MARKER}}),
                               "metrics": MetricRecord({{"handled": HANDLED, "pid": os.getpid()}})}}), reply_to=msg)
'''

_SERVER = '''import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    deadline = time.monotonic() + 60
    while not (nodes := sorted(grid.get_node_ids())) and time.monotonic() < deadline:
        time.sleep(0.5)
    rounds = []
    for i in range(int(config["messages"])):
        crash = int(config["crash"]) and i == 0
        out = [Message(RecordDict({{"config": ConfigRecord({{"crash": int(crash)}})}}), dst_node_id=node,
                       message_type="train") for node in nodes]
        replies = grid.send_and_receive(out, timeout=float(config["crash-timeout"] if crash else config["timeout"]))
        rounds.append([
            None if r.has_error() else {{"marker": r.content["reply"]["marker"],
                                        "handled": int(r.content["metrics"]["handled"]),
                                        "pid": int(r.content["metrics"]["pid"])}}
            for r in replies
        ])
    Path(str(config["out"])).write_text(json.dumps(rounds))
'''


def write_marker_app(directory: Path, marker: str) -> Path:
    package = directory / "markerapp"
    package.mkdir(parents=True, exist_ok=True)
    (directory / "pyproject.toml").write_text(_PYPROJECT)
    (package / "__init__.py").write_text("")
    (package / "client_app.py").write_text(_CLIENT.format(marker=marker))
    (package / "server_app.py").write_text(_SERVER.format())
    return directory
