"""Device placement without a GPU (the GPU issue's class of bug CI could not see): a model whose
parameters sit on PyTorch's ``meta`` device stands in for one on a GPU. Every batch that reaches
it must be on its device first, and what evaluation returns must be on the host; the old
``predict`` fed CPU batches to the model wherever it was, which failed every GPU run at its first
held-out evaluation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from fedge.edge_client.trainer import train_local
from fedge.tasks import TensorData, evaluate, make_task
from fedge.tasks.device import DeviceUnavailable, model_device, resolve_device, to_device, to_host


class _Elsewhere(nn.Module):
    """A 'model' on the meta device: it checks where each batch is and records it, and answers with
    plausible CPU outputs (a meta tensor has no values), so evaluation and training run around it."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(classes, device="meta"))
        self.cpu_weight = nn.Parameter(torch.zeros(classes))  # what the loss differentiates, on the CPU
        self.seen: list[torch.device] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.device)
        assert x.device == self.weight.device, f"a batch on {x.device} reached a model on {self.weight.device}"
        return self.cpu_weight.expand(x.shape[0], -1) + 0.0


def test_evaluation_sends_each_batch_to_the_models_device_and_returns_host_tensors() -> None:
    task = make_task("digits")
    data = task.test_data()
    assert data is not None
    model = _Elsewhere(10)
    assert model_device(model).type == "meta"
    figures = evaluate(model, data, task, batch_size=128)
    assert model.seen and all(d.type == "meta" for d in model.seen)
    assert set(figures) >= {"loss", "accuracy"} and all(isinstance(v, float) for v in figures.values())


def test_local_training_sends_its_batches_to_the_models_device() -> None:
    task = make_task("digits")
    pool = task.train_pool()
    data = TensorData(pool.x[:64], pool.y[:64])
    model = _Elsewhere(10)

    class _Loss:  # the task's loss on whatever the model answered, with targets from the batch's device
        def __init__(self) -> None:
            self.targets: list[torch.device] = []

        def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            self.targets.append(targets.device)
            return outputs.pow(2).mean()

    loss = _Loss()
    task_on_meta = type("T", (), {"loss": staticmethod(loss)})()
    train_local(model, data, task_on_meta, epochs=1, lr=0.1, batch_size=16)  # type: ignore[arg-type]
    assert len(model.seen) == 4 and all(d.type == "meta" for d in model.seen)
    assert all(d.type == "meta" for d in loss.targets)


def test_the_helpers_leave_tensors_in_place_when_they_are_there() -> None:
    x = torch.ones(3)
    assert to_device(x, torch.device("cpu")) is x and to_host(x).data_ptr() == x.data_ptr()
    assert model_device(nn.Sequential()) == torch.device("cpu")
    assert to_device(x, torch.device("meta")).device.type == "meta"


def test_a_device_is_named_or_refused_with_what_this_machine_has() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolve_device("auto") == (torch.device("cuda", 0) if gpus else torch.device("cpu"))
    with pytest.raises(DeviceUnavailable, match="auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    with pytest.raises(DeviceUnavailable, match=f"this machine has {gpus} CUDA device"):
        resolve_device(f"cuda:{gpus}")


def test_the_warm_parent_imports_and_warms_up_without_touching_cuda() -> None:
    """CUDA does not survive a fork after the parent initialised it: the warm executor's parent
    must import and warm up everything a message needs without one call into torch.cuda; each
    forked child asks for its own device (``resolve_device``). Every entry to CUDA raises here."""
    script = """
import torch
def refuse(*a, **k):
    raise AssertionError("the warm parent called into torch.cuda")
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device"):
    setattr(torch.cuda, name, refuse)
from fedge.edge_client.warm_executor import WarmExecutor, WarmNode
executor = WarmExecutor([WarmNode.parse("127.0.0.1:1")])
executor.warm_up()
assert not torch.cuda.is_initialized()
print("warm without cuda")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0 and "warm without cuda" in done.stdout, done.stderr[-2000:]
