"""FedNova in a user's Flower app: ``layered(FedAvg(), NormalizedAveraging(...))`` with a ClientApp
that reports its local steps, in-process (a Grid stand-in): one round moves the model by the
paper's rule, the same layer Fedge's engine runs for ``algorithm = "fednova"``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedge.aggregation.fednova import step_norm
from fedge.flower import NormalizedAveraging, layered
from tests.flower.test_compressed_strategy import _flat, _model
from tests.flower.test_tracked import RoundGrid
from tests.flower.test_fedbuff_strategy import Clock

#: node -> (examples, local steps)
DEVICES = {11: (40, 5), 12: (100, 30), 13: (10, 2)}


def _app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:  # a user's loop that counts its steps
        state = msg.content["arrays"].to_torch_state_dict()
        g = torch.Generator().manual_seed(context.node_id)
        trained = {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                   for k, v in state.items()}
        examples, steps = DEVICES[context.node_id]
        return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord(
            {"num-examples": examples, "local-steps": steps, "train_loss": 1.0})}), reply_to=msg)

    return app


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_one_round_in_a_flower_app_is_the_papers_rule(momentum) -> None:
    grid = RoundGrid({n: _app() for n in DEVICES}, {n: 0.0 for n in DEVICES}, Clock())
    start = _model()
    strategy = layered(FedAvg(fraction_evaluate=0.0), NormalizedAveraging(momentum=momentum))
    result = strategy.start(grid, start, num_rounds=1, train_config=ConfigRecord({"lr": 0.1}))
    x = _flat(start)
    deltas = {}
    for node in DEVICES:  # what each device sent, as the app computes it
        reply = _app()(Message(RecordDict({"arrays": start, "config": ConfigRecord({"lr": 0.1})}), dst_node_id=node,
                               message_type="train"),
                       Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={}))
        deltas[node] = _flat(reply.content["arrays"]) - x
    n = sum(e for e, _ in DEVICES.values())
    norms = {node: step_norm(s, momentum) for node, (_, s) in DEVICES.items()}
    tau_eff = sum(e / n * norms[node] for node, (e, _) in DEVICES.items())
    want = x + tau_eff * sum(e / n * deltas[node] / norms[node] for node, (e, _) in DEVICES.items())
    np.testing.assert_allclose(_flat(result.arrays), want, rtol=1e-5, atol=1e-6)
