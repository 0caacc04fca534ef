"""The cloud trainer's batches: sliced on the device in exactly the DataLoader's order."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fedge.deploy.batches import DeviceBatches, make_batches
from fedge.deploy.train import parse_args, peak_rate
from fedge.tasks import TensorData


@pytest.mark.parametrize("samples,world,batch", [(103, 2, 8), (100, 3, 16), (37, 1, 5)])
def test_device_batches_hold_what_the_data_loader_yields_in_its_order(samples: int, world: int, batch: int) -> None:
    data = TensorData(torch.randn(samples, 3), torch.arange(samples))
    for rank in range(world):
        for epoch in range(3):
            samplers = [DistributedSampler(TensorDataset(data.x, data.y), num_replicas=world, rank=rank,
                                           shuffle=True, seed=5) for _ in range(2)]
            for sampler in samplers:
                sampler.set_epoch(epoch)
            loaded = list(DataLoader(TensorDataset(data.x, data.y), batch_size=batch, sampler=samplers[0],
                                     drop_last=True))
            sliced = list(DeviceBatches(data, samplers[1], batch, torch.device("cpu")))
            assert len(sliced) == len(loaded) == len(DeviceBatches(data, samplers[1], batch, torch.device("cpu")))
            for (x, y), (lx, ly) in zip(sliced, loaded, strict=True):
                assert torch.equal(y, ly) and torch.equal(x, lx)


def test_data_not_in_memory_takes_the_loader_or_is_refused_with_why() -> None:
    dataset = TensorDataset(torch.randn(10, 2), torch.zeros(10, dtype=torch.long))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    batches, path = make_batches("auto", dataset, sampler, 4, torch.device("cpu"))
    assert path == "loader" and isinstance(batches, DataLoader)
    with pytest.raises(ValueError, match="not tensors in memory.*--data loader"):
        make_batches("device", dataset, sampler, 4, torch.device("cpu"))
    in_memory = TensorData(torch.randn(10, 1, 2, 2), torch.zeros(10, dtype=torch.long))
    batches, path = make_batches("auto", in_memory, sampler, 4, torch.device("cpu"), channels_last=True)
    assert path == "device"
    assert next(iter(batches))[0].is_contiguous(memory_format=torch.channels_last)


def test_the_rate_is_scaled_only_when_asked() -> None:
    """``--batch-size 256`` with the old default scaling (base 32) ran at 0.4 and went to chance."""
    args = parse_args(["--out", "x", "--batch-size", "256"])
    assert args.base_batch == 0 and peak_rate(args.lr, 256, args.base_batch) == args.lr == 0.05
    assert peak_rate(0.05, 256, 32) == pytest.approx(0.4)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_run_is_bit_identical_on_either_data_path(tmp_path) -> None:
    """One process, the same seed: the model trained from device-held batches is the model trained
    from the DataLoader's, to the last bit (only where batches are cut changed)."""
    summaries = {}
    for path in ("device", "loader"):
        out = tmp_path / path
        command = [sys.executable, "-m", "fedge.deploy.train", "--out", str(out), "--device", "cpu", "--data", path,
                   "--epochs", "2", "--batch-size", "64", "--seed", "4"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=200, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        summaries[path] = json.loads((out / "summary.json").read_text())
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["data"] == path and rows[-1]["amp"] == "off" and rows[-1]["samples_per_s"] > 0
        assert rows[-1]["gpu_span"] is None  # no GPU clock on the CPU
    assert summaries["device"]["parameter_digests"] == summaries["loader"]["parameter_digests"]
    assert summaries["device"]["accuracy"] == summaries["loader"]["accuracy"] > 0.5
