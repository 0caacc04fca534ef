"""An independent plain-torch FedAvg / FedNova loop on a NIID-Bench Fashion-MNIST split: a cross-check
of Fedge's engine, not a Fedge run.

Fedge supplies only the data, the split (``pathological:classes=2`` is NIID-Bench's #C=2) and the
``simple-cnn``; everything else is this file's own, written from the papers' update rules:
clients train one after another in this process with ``torch.optim.SGD`` (a fresh optimizer and
momentum buffer per round, as NIID-Bench's clients), over shuffled mini-batches of 64, then

* FedAvg: ``x <- sum_i p_i x_i``;
* FedNova (Wang et al. 2020, NIID-Bench's ``experiments.py``): ``a_i = (tau_i - rho (1 - rho^tau_i)
  / (1 - rho)) / (1 - rho)``, ``d_i = (x - x_i) / a_i``, ``x <- x - (sum_i p_i a_i) sum_i p_i d_i``,

with ``p_i = n_i / n``, and the test accuracy after every round (the figure is the best over rounds,
NIID-Bench's metric). No engine, device, codec, layer or aggregation code of Fedge runs, so if this
loop reaches what Fedge's engine reached on the same split, the engine is not why the two differ
from a published figure.

    .venv/bin/python bench/niid_reference.py --algorithm fednova --out bench/results/niid-bench/reference
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from fedge.tasks import make_task
from fedge.tasks.base import TensorData
from fedge.tasks.partition import partition_indices


def _local(model: torch.nn.Module, data: TensorData, args: argparse.Namespace, generator: torch.Generator,
           task) -> int:  # type: ignore[no-untyped-def]
    """Train ``model`` in place for ``args.epochs`` shuffled passes; the number of SGD steps."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model.train()
    steps = 0
    for _ in range(args.epochs):
        order = torch.randperm(len(data), generator=generator)
        for start in range(0, len(data), args.batch_size):
            batch = order[start:start + args.batch_size]
            opt.zero_grad()
            task.loss(model(data.x[batch]), data.y[batch]).backward()
            opt.step()
            steps += 1
    return steps


@torch.no_grad()
def _accuracy(model: torch.nn.Module, test: TensorData) -> float:
    model.eval()
    correct = sum(int((model(test.x[i:i + 1000]).argmax(1) == test.y[i:i + 1000]).sum())
                  for i in range(0, len(test), 1000))
    return correct / len(test)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", choices=["fedavg", "fednova"], required=True)
    parser.add_argument("--partitioning", default="pathological:classes=2")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--samples", type=int, default=0, help="each client's first N samples only (0: all; a smoke run)")
    parser.add_argument("--out", type=Path, required=True, help="folder for <name>.jsonl, one line per round")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    task = make_task("fashion:model=simple-cnn")
    pool, test = task.train_pool(), task.test_data()
    assert isinstance(pool, TensorData) and isinstance(test, TensorData)
    labels = tuple(int(v) for v in pool.y.tolist())
    parts = [pool.subset(partition_indices(labels, args.partitioning, args.clients, i)[:args.samples or None])
             for i in range(args.clients)]
    weights = torch.tensor([len(p) for p in parts], dtype=torch.float64)
    p = (weights / weights.sum()).tolist()
    model = task.build_model()
    x = [t.detach().clone() for t in model.parameters()]
    generator = torch.Generator().manual_seed(args.seed)
    name = f"{args.algorithm}-{args.partitioning.replace(':', '-').replace('=', '')}-wd{args.weight_decay:g}-s{args.seed}"
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / f"{name}.jsonl").open("w")
    best = 0.0
    for round_number in range(1, args.rounds + 1):
        started = time.perf_counter()
        new = [torch.zeros_like(t) for t in x]
        direction, tau_eff = [torch.zeros_like(t) for t in x], 0.0
        for i, data in enumerate(parts):
            with torch.no_grad():
                for param, value in zip(model.parameters(), x):
                    param.copy_(value)
            steps = _local(model, data, args, generator, task)
            trained = [t.detach() for t in model.parameters()]
            if args.algorithm == "fedavg":
                for acc, t in zip(new, trained):
                    acc.add_(t, alpha=p[i])
                continue
            rho = args.momentum
            a_i = (steps - rho * (1 - rho ** steps) / (1 - rho)) / (1 - rho) if rho else float(steps)
            tau_eff += p[i] * a_i
            for acc, start, t in zip(direction, x, trained):
                acc.add_((start - t) / a_i, alpha=p[i])
        if args.algorithm == "fednova":
            new = [start - tau_eff * d for start, d in zip(x, direction)]
        x = new
        with torch.no_grad():
            for param, value in zip(model.parameters(), x):
                param.copy_(value)
        accuracy = _accuracy(model, test)
        best = max(best, accuracy)
        line = {"round": round_number, "accuracy": accuracy, "best": best, "seconds": time.perf_counter() - started}
        log.write(json.dumps(line) + "\n")
        log.flush()
        print(json.dumps(line), flush=True)
    print(f"{name}: best accuracy {best * 100:.2f}% over {args.rounds} rounds "
          f"(command: .venv/bin/python bench/niid_reference.py {' '.join(argv or sys.argv[1:])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
