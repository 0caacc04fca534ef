"""Local training: it learns, FedProx limits drift, and it takes torch's own SGD steps."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedge.edge_client.trainer import train_local
from fedge.tasks import TensorData, evaluate, make_task


def _drift(model: torch.nn.Module, start: list[torch.Tensor]) -> float:
    return sum(float((p.detach() - s).pow(2).sum()) for p, s in zip(model.parameters(), start))


def test_local_training_learns_and_fedprox_limits_drift() -> None:
    task = make_task("digits")
    data = task.partition(0, 4, "iid")
    drifts = {}
    for mu in (0.0, 1.0):
        torch.manual_seed(0)
        model = task.build_model()
        start = [p.detach().clone() for p in model.parameters()]
        result = train_local(model, data, task, epochs=10, lr=0.05, batch_size=32, momentum=0.9, prox_mu=mu,
                             generator=torch.Generator().manual_seed(1))
        drifts[mu] = _drift(model, start)
        assert result.examples == len(data) and result.steps == 10 * -(-len(data) // 32)
        if mu == 0.0:
            assert evaluate(model, task.test_data(), task)["accuracy"] > 0.5
    assert drifts[1.0] < drifts[0.0]


def _reference_train(model: torch.nn.Module, data: TensorData, *, epochs: int, lr: float, batch_size: int,
                     momentum: float, weight_decay: float, generator: torch.Generator) -> None:
    """The textbook loop with ``torch.optim.SGD``: what train_local must match bit for bit."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=generator)
        for start in range(0, len(data), batch_size):
            index = order[start : start + batch_size]
            loss = torch.nn.functional.cross_entropy(model(data.x[index]), data.y[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 1e-3)])
def test_train_local_takes_exactly_torch_optim_sgds_steps(momentum: float, weight_decay: float) -> None:
    task = make_task("digits")
    data = task.partition(0, 10, "iid")
    torch.manual_seed(0)
    ours = task.build_model()
    theirs = copy.deepcopy(ours)
    train_local(ours, data, task, epochs=2, lr=0.1, batch_size=32, momentum=momentum, weight_decay=weight_decay,
                generator=torch.Generator().manual_seed(1))
    _reference_train(theirs, data, epochs=2, lr=0.1, batch_size=32, momentum=momentum,
                     weight_decay=weight_decay, generator=torch.Generator().manual_seed(1))
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), name


def test_train_local_does_not_import_torch_dynamo() -> None:
    """A ClientApp process runs one message: importing torch._dynamo (~1.9 s of CPU) would be paid on
    every message (see trainer._sgd_step)."""
    code = ("import sys, torch; from fedge.tasks import make_task; from fedge.edge_client.trainer import train_local; "
            "t = make_task('digits'); m = t.build_model(); "
            "train_local(m, t.partition(0, 10, 'iid'), t, epochs=1, lr=0.1, batch_size=32, momentum=0.9); "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.strip() == "False"


def test_a_node_trains_where_its_node_config_says_or_is_refused() -> None:
    from flwr.app import Context, RecordDict

    from fedge.edge_client.local import node_device
    from fedge.protocol import ProtocolError

    def context(config: dict) -> Context:
        return Context(run_id=1, node_id=1, node_config=config, state=RecordDict(), run_config={})

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert node_device(context({})) == (torch.device("cuda", 0) if gpus else torch.device("cpu"))
    assert node_device(context({"device": "cpu"})) == torch.device("cpu")
    with pytest.raises(ProtocolError, match=f"node config: device 'cuda:{gpus}'"):
        node_device(context({"device": f"cuda:{gpus}"}))


def test_the_runs_weight_decay_reaches_every_devices_sgd_and_nonsense_is_refused_on_both_sides(tmp_path) -> None:
    """``weight-decay`` (NIID-Bench's baseline trains with 1e-5) travels in the round's config only when
    set (a run without it sends the same messages as before) and is the device's SGD weight decay."""
    from fedge.edge_client.local import train as device_train
    from fedge.protocol import ProtocolError
    from fedge.protocol.config_keys import WEIGHT_DECAY
    from fedge.protocol.round_config import RoundConfig
    from fedge.server.engine.loop import make_context
    from fedge.server.settings import RunSettings, SettingsError

    task = make_task("digits")
    plain = make_context(RunSettings(run_dir=str(tmp_path)), task).round_config(1)
    assert WEIGHT_DECAY not in plain.extra
    config = make_context(RunSettings(run_dir=str(tmp_path), weight_decay=1e-3, momentum=0.9), task).round_config(1)
    config = RoundConfig.from_record(config.to_record())  # as the device reads it
    assert config.extra[WEIGHT_DECAY] == 1e-3
    data = task.partition(0, 10, "iid")
    torch.manual_seed(0)
    ours = task.build_model()
    theirs = copy.deepcopy(ours)
    device_train(ours, data, config, torch.Generator().manual_seed(1))
    train_local(theirs, data, task, epochs=config.local_epochs, lr=config.lr, batch_size=config.batch_size,
                momentum=0.9, weight_decay=1e-3, generator=torch.Generator().manual_seed(1))
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), name
    for bad in (-1e-3, 1.0, float("nan")):
        with pytest.raises(SettingsError, match="weight-decay"):
            RunSettings(run_dir=str(tmp_path), weight_decay=bad)
        forged = RoundConfig.from_record(plain.to_record())
        forged.extra[WEIGHT_DECAY] = bad
        with pytest.raises(ProtocolError, match=WEIGHT_DECAY):
            device_train(task.build_model(), data, forged, torch.Generator().manual_seed(1))
