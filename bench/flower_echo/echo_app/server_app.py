"""ServerApp: each round sends one query message of ``payload-bytes`` to every node and waits for all
replies; one JSON line per round (messages sent and replied, seconds)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rounds = int(context.run_config["num-server-rounds"])
    nodes_wanted = int(context.run_config["min-nodes"])
    size = int(context.run_config["payload-bytes"])
    out_path = Path(str(context.run_config["out-path"]))
    while len(list(grid.get_node_ids())) < nodes_wanted:
        time.sleep(0.2)
    nodes = list(grid.get_node_ids())
    payload = ArrayRecord({"x": Array(np.zeros(size, dtype=np.uint8))})
    for server_round in range(1, rounds + 1):
        started = time.monotonic()
        messages = [Message(RecordDict({"payload": payload}), dst_node_id=node, message_type=MessageType.QUERY)
                    for node in nodes]
        replies = list(grid.send_and_receive(messages, timeout=600))
        ok = sum(1 for r in replies if not r.has_error())
        with out_path.open("a") as handle:
            handle.write(json.dumps({"round": server_round, "sent": len(messages), "replied": ok,
                                     "seconds": time.monotonic() - started}) + "\n")
