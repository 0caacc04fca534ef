"""Screen error-feedback schemes for sparse uplinks at partial participation, in one process.

A federated run on Flower's simulation engine takes ~40 s on this machine; this loop takes ~9 s, so a
candidate scheme can be tried over several seeds before it is built into the engine. It uses
Fedge's own task, local trainer and codecs; only the federation (sampling, aggregation) is an
in-process loop, and that is why it is a screen, not a result: every figure that goes into
docs/results.md comes from ``bench/bidirectional.py`` on Flower. Partitions are sampled from the
seed here (on Flower's simulation the node ids are random per run, so the same seed samples other
partitions; see bench/results/NOTEBOOK.md).

Schemes (``--scheme``):

* ``fp32`` - FedAvg, dense updates.
* ``ef`` - the engine's scheme: each client keeps the memory of its codec (error feedback's
  residual, or DGC's momentum and accumulation) and sends ``codec(update + memory)``.
* ``ef21`` - EF21 (Richtarik, Sokolov, Fatkhullin, NeurIPS 2021, https://arxiv.org/abs/2106.05203):
  client ``i`` and the server both hold an estimate ``g_i`` of the client's update; the client sends
  ``codec(update - g_i)``, both add it to ``g_i``; the server averages the sampled clients' ``g_i``.
* ``ef21-pp`` - EF21 with partial participation as in MIFA (Gu et al., NeurIPS 2021,
  https://arxiv.org/abs/2106.04159): the server applies the weighted average of *every* client's
  latest ``g_i`` each round (kept as one running sum, O(model) on the server).

    .venv/bin/python bench/partial_participation_screen.py --scheme ef --codec "dgc:ratio=0.01,sample=0.05+qsgd:bits=4"
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import numpy as np
import torch

from fedge.compression.registry import make_codec
from fedge.edge_client.trainer import train_local
from fedge.tasks import evaluate, make_task

SCHEMES = ("fp32", "ef", "ef21", "ef21-pp", "fetchsgd")


class CountSketch:
    """A count sketch of an n-vector: ``rows`` hash rows of ``columns`` signed buckets (linear, so
    sketches of updates add and scale like the updates)."""

    def __init__(self, n: int, rows: int, columns: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows, self.columns = rows, columns
        self.bucket = torch.randint(0, columns, (rows, n), generator=g)
        self.sign = torch.randint(0, 2, (rows, n), generator=g).float() * 2 - 1

    def sketch(self, v: torch.Tensor) -> torch.Tensor:
        table = torch.zeros(self.rows, self.columns)
        for r in range(self.rows):
            table[r].index_add_(0, self.bucket[r], self.sign[r] * v)
        return table

    def estimate(self, table: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.sign[r] * table[r, self.bucket[r]] for r in range(self.rows)]).median(0).values


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def run(args: argparse.Namespace, seed: int) -> tuple[float, float, float]:
    """Final accuracy, the mean over the last ten rounds, and the final accuracy of the server's
    exponential moving average of the model (``--ema``; the raw model when 0)."""
    task = make_task(args.task)
    parts = [task.partition(i, args.clients, args.partitioning) for i in range(args.clients)]
    test = task.test_data()
    torch.manual_seed(seed)
    model = task.build_model()
    x = flat(model)
    n = x.numel()
    rng = np.random.default_rng(seed)
    codec = make_codec(args.codec) if args.scheme != "fp32" else None
    memory: dict[int, dict[str, torch.Tensor]] = {}
    last_sent: dict[int, int] = {}
    estimate: dict[int, torch.Tensor] = {}
    running, running_weight, weights = torch.zeros(n), 0.0, {}
    velocity = torch.zeros(n)
    if args.scheme == "fetchsgd":
        cs = CountSketch(n, args.sketch_rows, max(1, int(args.sketch_columns * n)), seed)
        s_momentum = torch.zeros(cs.rows, cs.columns)
        s_error = torch.zeros(cs.rows, cs.columns)
        k = max(1, int(args.fetch_k * n))
    ema = x.clone()
    history: list[float] = []
    for step in range(1, args.rounds + 1):
        total = torch.zeros(cs.rows, cs.columns) if args.scheme == "fetchsgd" else torch.zeros(n)
        total_weight, weight_sum = 0.0, 0.0
        for i in (int(c) for c in rng.choice(args.clients, args.per_round, replace=False)):
            torch.nn.utils.vector_to_parameters(x.clone(), model.parameters())
            result = train_local(model, parts[i], task, epochs=args.local_epochs, lr=args.lr, batch_size=32,
                                 generator=torch.Generator().manual_seed(seed * 100_003 + step * 1_009 + i))
            update, weight = flat(model) - x, float(result.examples)
            if args.scheme == "fetchsgd":
                sent = cs.sketch(update)  # stateless client: the sketch of its update
            elif codec is None:
                sent = update
            elif args.scheme == "ef":
                wire = codec.for_round(step, seed)
                mem = codec.make_memory(wire, n, memory.get(i))
                if i in last_sent and hasattr(mem, "age"):
                    mem.age(step - last_sent[i])
                sent = wire.decode(mem.encode(update), n)
                memory[i], last_sent[i] = dict(mem.state_dict()), step
            else:
                wire = codec.for_round(step, seed)
                g = estimate.get(i, torch.zeros(n))
                correction = wire.decode(wire.encode(update - g), n)
                estimate[i] = sent = g + correction
                if args.scheme == "ef21-pp":
                    running += weight * correction
                    if i not in weights:
                        weights[i] = weight
                        running_weight += weight
            if args.aggregate == "coordinate" and args.scheme != "fetchsgd":
                total += weight * sent
                total_weight = total_weight + weight * (sent != 0).float()
                weight_sum += weight
            else:
                total += weight * sent
                total_weight += weight
        if args.scheme == "fetchsgd":
            # FetchSGD (Rothchild et al., ICML 2020): momentum and error accumulate in sketch space on
            # the server; the k heavy coordinates are unsketched, applied, and removed from the error.
            s_momentum = args.server_momentum * s_momentum + total / total_weight
            s_error += args.server_lr * s_momentum
            estimate_ = cs.estimate(s_error)
            delta = torch.zeros(n)
            top = estimate_.abs().topk(k).indices
            delta[top] = estimate_[top]
            sketched = cs.sketch(delta)
            s_error -= sketched
            s_momentum[sketched != 0] = 0
            x = x + delta
            continue
        if args.aggregate == "coordinate" and args.scheme != "fetchsgd":
            step_weight = float(weight_sum)
            total_weight = torch.clamp(total_weight, min=max(args.floor * step_weight, 1e-12))
        step_update = running / running_weight if args.scheme == "ef21-pp" else total / total_weight
        velocity = args.server_momentum * velocity + step_update
        x = x + args.server_lr * velocity
        ema = args.ema * ema + (1 - args.ema) * x
        if step > args.rounds - 10:
            torch.nn.utils.vector_to_parameters(x, model.parameters())
            history.append(float(evaluate(model, test, task)["accuracy"]))
    torch.nn.utils.vector_to_parameters(ema, model.parameters())
    return history[-1], statistics.mean(history), float(evaluate(model, test, task)["accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scheme", choices=SCHEMES, default="ef")
    parser.add_argument("--codec", default="dgc:ratio=0.01,sample=0.05+qsgd:bits=4")
    parser.add_argument("--task", default="digits")
    parser.add_argument("--partitioning", default="dirichlet:alpha=0.5")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--server-lr", type=float, default=1.0)
    parser.add_argument("--server-momentum", type=float, default=0.0, help="FedAvgM / FetchSGD momentum")
    parser.add_argument("--aggregate", choices=("mean", "coordinate"), default="mean",
                        help="coordinate: each coordinate averaged over the clients that sent it")
    parser.add_argument("--floor", type=float, default=0.0,
                        help="coordinate: the divisor is at least this fraction of the step's weight")
    parser.add_argument("--sketch-rows", type=int, default=1)
    parser.add_argument("--sketch-columns", type=float, default=0.02, help="columns as a fraction of n")
    parser.add_argument("--fetch-k", type=float, default=0.01, help="coordinates unsketched per round")
    parser.add_argument("--ema", type=float, default=0.0, help="server EMA of the model (reported separately)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="The specified min_partition_size")  # flwr-datasets redraws
    runs = [run(args, seed) for seed in args.seeds]
    label = args.scheme if args.scheme == "fp32" else f"{args.scheme} {args.codec}"
    for name, column in (("final", 0), ("last-10 mean", 1), (f"ema {args.ema:g}", 2)):
        accuracies = [r[column] for r in runs]
        print(f"{label} (server lr {args.server_lr:g}, momentum {args.server_momentum:g}, {args.aggregate}, "
              f"floor {args.floor:g}) {name}: " + ", ".join(f"{a:.2%}" for a in accuracies)
              + f"; mean {statistics.mean(accuracies):.2%}")


if __name__ == "__main__":
    main()
