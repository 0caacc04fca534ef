"""digitsapp: the ServerApp."""

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from fedge.flower import compressed

from digitsapp.task import Net, load_test, test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run FedAvg for num-server-rounds rounds, evaluating the global model on held-out digits."""
    torch.manual_seed(int(context.run_config["seed"]))
    arrays = ArrayRecord(Net().state_dict())
    strategy = compressed(FedAvg(fraction_train=float(context.run_config["fraction-train"]), fraction_evaluate=0.0), uplink=str(context.run_config["uplink"]), downlink=str(context.run_config["downlink"]), start=str(context.run_config["start"]) or None)
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=int(context.run_config["num-server-rounds"]),
                            train_config=ConfigRecord({"lr": float(context.run_config["lr"])}),
                            evaluate_fn=global_evaluate)
    if context.run_config["results"]:
        with open(str(context.run_config["results"]), "w", encoding="utf-8") as handle:
            json.dump({"evaluate": {r: dict(m) for r, m in result.evaluate_metrics_serverapp.items()},
                       "train": {r: dict(m) for r, m in result.train_metrics_clientapp.items()}}, handle)


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Accuracy and loss of the global model on the server's held-out digits."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, accuracy = test(model, load_test())
    return MetricRecord({"accuracy": accuracy, "loss": loss})
