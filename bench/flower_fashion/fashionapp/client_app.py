"""fashionapp: the ClientApp."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from fedge.flower import compression_mod

from fashionapp.task import Net, load_data
from fashionapp.task import train as train_fn

app = ClientApp(mods=[compression_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model on this client's data."""
    torch.set_num_threads(1)
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loader = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]),
                       int(context.run_config["batch-size"]), float(context.run_config["dirichlet-alpha"]),
                       int(context.run_config["seed"]), int(msg.content["config"]["server-round"]))
    train_loss = train_fn(model, loader, int(context.run_config["local-epochs"]), float(msg.content["config"]["lr"]))
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(loader.dataset)})
    return Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)
