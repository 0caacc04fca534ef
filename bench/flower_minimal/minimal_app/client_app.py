"""ClientApp: train the received model on this node's shard with plain SGD, reply with fp32 weights."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from minimal_app.data import shard
from minimal_app.model import DigitsCNN

app = ClientApp()


def _process_started() -> float | None:
    """Wall-clock (epoch) time this process started, from /proc (Linux; None elsewhere): the reply
    reports how long the ClientApp process lived, imports and start-up included."""
    try:
        stat = Path("/proc/stat").read_text().splitlines()
        boot = next(float(line.split()[1]) for line in stat if line.startswith("btime "))
        ticks = int(Path("/proc/self/stat").read_text().rsplit(") ", 1)[1].split()[19])
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return None


@app.train()
def train(msg: Message, context: Context) -> Message:
    # One intra-op thread, as Fedge's ClientApp uses by default (edge_client/threads.py): the
    # deployment engine starts a ClientApp process per message next to the other nodes' on the same
    # cores, and torch's thread per core would oversubscribe them. Same setting on both sides keeps
    # the comparison about framework overhead, not about thread contention.
    torch.set_num_threads(1)
    started = time.perf_counter()
    partition = int(context.node_config["partition-id"])
    x, y = shard(partition, int(context.node_config["num-partitions"]))
    data_seconds = time.perf_counter() - started

    # seeded shuffles per (node, round), as Fedge seeds its own: a run repeats exactly
    generator = torch.Generator().manual_seed(1000 * partition + int(msg.content["config"]["server-round"]))
    model = DigitsCNN()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    epochs = int(context.run_config["local-epochs"])
    lr = float(context.run_config["lr"])
    batch_size = int(context.run_config["batch-size"])

    # measured as Fedge's train_local measures it: optimizer set-up to the end of the last epoch
    train_started = time.perf_counter()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), batch_size):
            index = order[start : start + batch_size]
            loss = torch.nn.functional.cross_entropy(model(x[index]), y[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    train_seconds = time.perf_counter() - train_started

    values = {"num-examples": len(y), "train-seconds": train_seconds, "data-seconds": data_seconds}
    process_started = _process_started()
    if process_started is not None:
        values["process-seconds"] = time.time() - process_started
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(values)})
    return Message(content, reply_to=msg)
