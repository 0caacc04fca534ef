"""ServerApp: Flower's built-in FedAvg over every node, evaluation on the held-out split on the server.

``evaluate_fn`` (called by ``Strategy.start`` before round 1 and after each round) appends one JSON
line per call to ``out-path``: the round, held-out accuracy, ``time.monotonic()`` at the call, and
the largest ``train-seconds`` among that round's replies, and for the reply whose ClientApp process
had lived longest when it replied, that age, its data loading (scikit-learn's import included) and
its training time.
A round's wall time is the difference of consecutive ``time`` values.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from minimal_app.data import split
from minimal_app.model import DigitsCNN

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rounds = int(context.run_config["num-server-rounds"])
    out_path = Path(str(context.run_config["out-path"]))
    nodes = int(context.run_config.get("min-nodes", 2))
    _, (x_test, y_test) = split()
    torch.manual_seed(42)
    model = DigitsCNN()
    latest: dict[str, object] = {"train-seconds": None, "process": None}

    def train_metrics(replies: list[RecordDict], weighted_by_key: str) -> MetricRecord:
        metrics = [r["metrics"] for r in replies]
        latest["train-seconds"] = max((float(m["train-seconds"]) for m in metrics), default=None)
        # the reply whose ClientApp process lived longest: its own split of that time
        timed = [m for m in metrics if "process-seconds" in m]
        slowest = max(timed, key=lambda m: float(m["process-seconds"]), default=None)
        latest["process"] = None if slowest is None else {
            key: float(slowest[key]) for key in ("process-seconds", "data-seconds", "train-seconds")
        }
        return aggregate_metricrecords(replies, weighted_by_key)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        now = time.monotonic()
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(dim=1) == y_test).float().mean())
        row = {"round": server_round, "accuracy": accuracy, "time": now,
               "train_seconds": latest["train-seconds"] if server_round else None,
               "slowest_process": latest["process"] if server_round else None,
               "evaluate_seconds": time.monotonic() - now}
        with out_path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        return MetricRecord({"accuracy": accuracy})

    # Wait for the nodes before the clock starts, as Fedge does (its rows start after its own wait);
    # FedAvg would otherwise wait inside round 1 (sample_nodes polls once a second).
    while len(list(grid.get_node_ids())) < nodes:
        time.sleep(0.2)
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes,
                      min_available_nodes=nodes, train_metrics_aggr_fn=train_metrics)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
                   evaluate_fn=evaluate)
