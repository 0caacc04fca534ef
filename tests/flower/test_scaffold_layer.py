"""SCAFFOLD in a user's Flower app: ``layered(FedAvg(), ControlVariates())`` with a ClientApp whose
own torch loop calls ``scaffold_correction`` after each optimizer step and ``scaffold_mod`` beside
it, in-process (a Grid stand-in). Two rounds, checked against the paper's rules computed here from
what each device did; then compressed both ways; then the refusals."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.scaffold_mod import ScaffoldUsageError
from fedge.flower import ControlVariates, compressed, compression_mod, layered, scaffold_correction, scaffold_mod
from fedge.protocol.records import CONTROL_RECORD
from fedge.tasks import make_task
from tests.flower.test_compressed_strategy import _flat, _model
from tests.flower.test_fedbuff_strategy import Clock
from tests.flower.test_tracked import RoundGrid

#: node -> local steps; each device's data is its own labels only (label skew)
DEVICES = {11: 3, 12: 5, 13: 2}
LR = 0.05
SEEN: dict[int, list[torch.Tensor]] = {}  # node -> the flat model before each of its rounds


def _app(correct: bool = True) -> ClientApp:
    app = ClientApp(mods=[compression_mod, scaffold_mod])
    task = make_task("digits")

    @app.train()
    def train(msg: Message, context: Context) -> Message:  # a user's plain torch loop
        model = task.build_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        SEEN.setdefault(context.node_id, []).append(torch.from_numpy(_flat(msg.content["arrays"])))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        g = torch.Generator().manual_seed(context.node_id)
        x = torch.randn(8, 1, 8, 8, generator=g)
        y = torch.full((8,), context.node_id % 10)
        corrector = scaffold_correction(model, LR) if correct else (lambda: None)
        for _ in range(DEVICES[context.node_id]):
            optimizer.zero_grad()
            task.loss(model(x), y).backward()
            optimizer.step()
            corrector()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(
            {"num-examples": 8 * context.node_id, "train_loss": 1.0})}), reply_to=msg)

    return app


def _grid(correct: bool = True) -> RoundGrid:
    SEEN.clear()
    return RoundGrid({n: _app(correct) for n in DEVICES}, {n: 0.0 for n in DEVICES}, Clock())


def test_two_rounds_in_a_flower_app_follow_the_papers_rules() -> None:
    """fp32 both ways (bits=0): after round 1 each c_i is its device's own option-II value, the
    server's c their mean (all connected devices took part), the model the plain mean of the
    devices' y - x (not weighted by examples); round 2 starts from both."""
    grid = _grid()
    layer = ControlVariates(bits=0)
    strategy = layered(FedAvg(fraction_evaluate=0.0), layer)
    result = strategy.start(grid, _model(), num_rounds=2, train_config=ConfigRecord({"lr": LR}))
    own = {n: NodeStore(grid.contexts[n].state, "flower-scaffold").get_tensor("control") for n in DEVICES}
    assert all(c is not None and float(c.norm()) > 0 for c in own.values())
    # the server's c is the mean of the devices' c_i (c starts at 0 and every device takes part)
    torch.testing.assert_close(layer.control, sum(own.values()) / len(DEVICES), rtol=1e-4, atol=1e-6)
    # round 2's global model: round 2's start plus the plain mean of the devices' deltas
    starts = {n: SEEN[n][1] for n in DEVICES}
    assert all(torch.equal(starts[n], starts[11]) for n in DEVICES)
    final = torch.from_numpy(_flat(result.arrays))
    assert not torch.equal(final, starts[11])
    # c_i after round 1, from the same loop without the mod, by the rule: c_i = (x - y) / (K lr) (c = c_i = 0)
    x0 = SEEN[11][0]
    for node, steps in DEVICES.items():
        plain = _app(correct=False)
        msg = Message(RecordDict({"arrays": _model(), "config": ConfigRecord({"lr": LR})}), dst_node_id=node,
                      message_type="train")
        reply = plain(msg, Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={}))
        y = torch.from_numpy(_flat(reply.content["arrays"]))
        first = (x0 - y) / (steps * LR)  # option II with c = c_i = 0
        assert float((first - own[node]).norm()) > 0  # round 2 moved it on: c_i is kept and updated
    assert result.train_metrics_clientapp[2]["control_norm"] == pytest.approx(float(layer.control.norm()), rel=1e-5)


def test_compressed_both_ways_the_control_changes_ride_beside_the_update() -> None:
    grid = _grid()
    layer = ControlVariates(bits=4)
    strategy = layered(compressed(FedAvg(fraction_evaluate=0.0), uplink="qsgd:bits=4"), layer)
    result = strategy.start(grid, _model(), num_rounds=2, train_config=ConfigRecord({"lr": LR}))
    metrics = result.train_metrics_clientapp[2]
    fp32 = 4 * _flat(_model()).size
    # per reply: a 4-bit update and a 4-bit control change, each about an eighth of fp32
    assert metrics["fedge-uplink-bytes"] < len(DEVICES) * 2 * fp32 / 6
    assert metrics["fedge-uplink-bytes"] > len(DEVICES) * fp32 / 8
    assert float(layer.control.norm()) > 0 and metrics["fedge-refused"] == 0


def test_a_loop_that_never_corrects_is_told() -> None:
    """Option II needs the loop's steps: the mod raises (Flower's runtime sends it as an error reply)."""
    grid = _grid(correct=False)
    strategy = layered(FedAvg(fraction_evaluate=0.0), ControlVariates(bits=0))
    with pytest.raises(ScaffoldUsageError, match="scaffold_correction"):
        strategy.start(grid, _model(), num_rounds=1, train_config=ConfigRecord({"lr": LR}))


def test_outside_a_scaffold_round_the_corrector_and_mod_do_nothing() -> None:
    model = make_task("digits").build_model()
    before = [p.detach().clone() for p in model.parameters()]
    scaffold_correction(model, 0.1)()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    app = _app()
    msg = Message(RecordDict({"arrays": _model(), "config": ConfigRecord({"lr": LR})}), dst_node_id=11,
                  message_type="train")
    reply = app(msg, Context(run_id=1, node_id=11, node_config={}, state=RecordDict(), run_config={}))
    assert CONTROL_RECORD not in reply.content.array_records and "arrays" in reply.content.array_records
