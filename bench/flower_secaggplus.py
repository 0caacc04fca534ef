"""Flower's own SecAgg+ (flwr 1.41, legacy workflow), measured the way bench/secure_aggregation.py
measures Fedge's: the protocol alone, in one process, n clients each with a d-coordinate update.

Flower's ``SecAggPlusWorkflow`` (inside ``DefaultWorkflow`` with its legacy ``FedAvg`` strategy, as
its documentation runs it) drives Flower's ``secaggplus_mod`` around a ``NumPyClient`` whose fit
returns a fixed random update; a small ``Grid`` delivers each message to the ClientApp in this
process and times every call per node. Reports, beside Fedge's figures: bytes per coordinate of the
masked upload as serialized (Flower's ConfigRecord of int64 arrays), a client's seconds per round
(all its stages, median), and the coordinator's seconds (the workflow's wall time minus the
clients'). ``--drop`` clients fail at the masked-input stage (after sharing keys).

    .venv/bin/python bench/flower_secaggplus.py --clients 100 --dimension 1000000 --drop 20
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from flwr.app import Context, Error, Message, RecordDict
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.supercore.run import Run
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp.grid import Grid
from flwr.supercore.task_identity import TaskIdentity


class LocalGrid(Grid):
    """Every message goes to the ClientApp in this process, at once; replies are timed per node."""

    def __init__(self, app: ClientApp, nodes: int, drop: set[int]) -> None:
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
        self.app = app
        self.contexts = {1000 + i: Context(run_id=1, node_id=1000 + i, node_config={"i": i}, state=RecordDict(),
                                           run_config={}) for i in range(nodes)}
        self.drop = {1000 + i for i in drop}
        self.seconds = {node: 0.0 for node in self.contexts}
        self.upload_bytes = {node: 0 for node in self.contexts}
        self._replies: dict[str, Message] = {}
        self._run = Run.create_empty(1)
        #: this stand-in's own serialization (a real deployment pays it in gRPC): not the coordinator's
        self.serde_seconds = 0.0

    def set_run(self, run_id: int) -> None:  # type: ignore[override]
        pass

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[no-untyped-def]
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            node = msg.metadata.dst_node_id
            configs = msg.content.config_records.get("secaggplus_configs") if msg.has_content() else None
            stage = configs.get("stage") if configs is not None else None
            wire = time.perf_counter()
            delivered = message_from_proto(message_to_proto(msg))  # each client gets its own copy, as on the wire
            self.serde_seconds += time.perf_counter() - wire
            started = time.perf_counter()
            try:
                if node in self.drop and stage == "collect_masked_vectors":
                    raise RuntimeError("dropped after sharing keys")
                reply = self.app(delivered, self.contexts[node])
            except Exception as err:  # what Flower's runtime does with a client's exception
                reply = Message(Error(code=2, reason=str(err)), reply_to=msg)
            self.seconds[node] += time.perf_counter() - started
            if reply.has_content():
                wire = time.perf_counter()
                self.upload_bytes[node] += message_to_proto(reply).ByteSize()
                self.serde_seconds += time.perf_counter() - wire
            self._replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(mid) for mid in list(message_ids) if mid in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(list(messages)))


def measure(clients: int, dimension: int, drop: int, num_shares: int, threshold: int) -> dict:
    """One SecAgg+ round of Flower's workflow over ``clients`` in-process clients; the figures."""
    update = np.random.default_rng(0).normal(0, 0.01, dimension).astype(np.float32)

    class Client(NumPyClient):
        def get_parameters(self, config):  # type: ignore[no-untyped-def]
            return [np.zeros_like(update)]

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            return [update], 1, {}

    app = ClientApp(client_fn=lambda context: Client().to_client(), mods=[secaggplus_mod])
    grid = LocalGrid(app, clients, set(range(drop)))
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=clients, min_available_clients=clients)
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
    workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=num_shares, reconstruction_threshold=threshold))
    started = time.perf_counter()
    workflow(grid, legacy)
    wall = time.perf_counter() - started
    alive = [n for n in grid.contexts if n - 1000 >= drop]
    if not any(grid.upload_bytes[n] for n in alive):
        raise RuntimeError("Flower's SecAgg+ round did not run (no client uploaded anything)")
    return {
        "flwr": "1.41.0", "clients": clients, "dimension": dimension, "dropped_after_sharing": drop,
        "num_shares": num_shares, "threshold": threshold,
        "client_seconds_median": statistics.median(grid.seconds[n] for n in alive),
        "client_seconds_max": max(grid.seconds[n] for n in alive),
        # the workflow's wall time minus the clients' (they ran in this process, one after another) and
        # minus this stand-in grid's serialization
        "coordinator_seconds": wall - sum(grid.seconds.values()) - grid.serde_seconds,
        "all_sent_bytes_per_coordinate": statistics.median(grid.upload_bytes[n] for n in alive) / dimension,
        "wall_seconds": wall,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--dimension", type=int, default=1_000_000)
    parser.add_argument("--drop", type=int, default=20)
    parser.add_argument("--num-shares", type=int, default=29, help="Flower counts the client itself: Fedge's k + 1")
    parser.add_argument("--threshold", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("bench/results/flower-secaggplus.json"))
    args = parser.parse_args(argv)
    report = {"command": " ".join([".venv/bin/python", "bench/flower_secaggplus.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(),
              **measure(args.clients, args.dimension, args.drop, args.num_shares, args.threshold)}
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
