"""FedBuff from a user's own ServerApp against Fedge's engine, with stragglers, side by side.

The straggler suite (``bench/algorithms.py --suite stragglers``): 16 clients on digits, Dirichlet(0.5),
4-bit QSGD with error feedback, 5 local epochs, a quarter of the clients ``slowdown=5`` (each sleeps
four times its real work: ``fedge.edge_client.slowdown``), one Ray actor per client on Flower's
simulation engine, so a sleeping client holds no CPU slot that the others wait for. Every
configuration does the same client work: 30 synchronous rounds of 16 updates, or 60 FedBuff
versions of 8 updates with 16 clients in flight.

Four runs, one after the other in one invocation:

- Fedge's engine (``fedge.server``): ``fedavg`` and ``fedbuff:concurrency=16,buffer=8``;
- ``examples/flower-app`` as a user runs it (their ``Net``, data loader and training loop): Flower's
  ``FedAvg`` wrapped by ``fedge.flower.compressed``, and ``fedge.flower.FedBuff`` called from the
  ServerApp against Flower's ``Grid``. The app gains two small files here: a ServerApp that picks
  the strategy from the run config and records the wall time of each evaluation, and a ClientApp
  that adds Fedge's ``slowdown_mod`` (the engine's own straggler emulation) in front of
  ``compression_mod``.

Reported per run: the time from the first message to the first model with held-out accuracy at or
above the target (95%), and the speed-up of FedBuff over the synchronous run on the same side. The
goal (issue 32): the app's speed-up within 20% of the engine's.

    .venv/bin/python bench/flower_stragglers.py
    .venv/bin/python bench/flower_stragglers.py --clients 8 --rounds 10 --target 0.9   # quicker
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.algorithms import run_one, time_to  # noqa: E402
from bench.flower_app import app_arguments, report  # noqa: E402
from fedge.launcher.environment import flower_environment  # noqa: E402
from fedge.launcher.processes import ProcessGroup  # noqa: E402
from fedge.launcher.sequence import FlowerLaunch  # noqa: E402
from bench.sigterm import stop_on_sigterm  # noqa: E402

APP = ROOT / "examples" / "flower-app"

SERVER_APP = '''"""The bench's ServerApp: the app's model and evaluation, the strategy named by the run config."""

import json
import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from fedge.flower import ControlVariates, ElasticAveraging, FedBuff, compressed, layered, secure

from digitsapp.server_app import global_evaluate
from digitsapp.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    torch.manual_seed(0)
    arrays = ArrayRecord(Net().state_dict())
    rounds, uplink = int(config["num-server-rounds"]), str(config["uplink"])
    train_config = ConfigRecord({"lr": float(config["lr"])})
    timeline = []
    started = time.monotonic()

    def evaluate(version: int, arrays: ArrayRecord) -> MetricRecord:
        metrics = global_evaluate(version, arrays)
        timeline.append([version, float(metrics["accuracy"]), time.monotonic() - started])
        return metrics

    downlink = str(config["downlink"])
    if config["strategy"] == "fedbuff":
        concurrency, buffer = int(config["concurrency"]), int(config["buffer"])
        result = FedBuff(concurrency=concurrency, buffer=buffer, uplink=uplink, downlink=downlink).start(
            grid, initial_arrays=arrays, num_versions=rounds * concurrency // buffer, train_config=train_config,
            evaluate_fn=evaluate)
    else:
        nodes = int(config["concurrency"])
        fedavg = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes)
        if config["strategy"] == "secure":  # the uplink names the secure-aggregation spec
            strategy = secure(fedavg, secure_aggregation=uplink, differential_privacy=str(config["dp"]))
        elif config["strategy"] == "easgd":  # the strategy's model is the center
            strategy = layered(compressed(fedavg, uplink=uplink, downlink=downlink), ElasticAveraging())
        elif config["strategy"] == "scaffold":  # control variates both ways, at 8 bits (fp32 for an fp32 run)
            strategy = layered(compressed(fedavg, uplink=uplink, downlink=downlink),
                               ControlVariates(bits=0 if uplink == "none" else 8))
        else:
            strategy = compressed(fedavg, uplink=uplink, downlink=downlink)
        result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=rounds, train_config=train_config,
                                evaluate_fn=evaluate)
    with open(str(config["results"]), "w", encoding="utf-8") as handle:
        json.dump({"timeline": timeline,
                   "train": {v: dict(m) for v, m in result.train_metrics_clientapp.items()}}, handle)
'''

CLIENT_APP = '''"""The bench's ClientApp: the app's train handler, slowed on the straggler partitions;
for SCAFFOLD the same handler training with the example's loop plus the one line SCAFFOLD adds."""

import torch
import torch.nn.functional as F
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from fedge.edge_client.slowdown import slowdown_mod
from fedge.flower import compression_mod, elastic_mod, scaffold_correction, scaffold_mod, secure_mod

import digitsapp.client_app as example
from digitsapp.client_app import train

# the slow clients are slow at encoding too; each mod passes through what the other's server sends
app = ClientApp(mods=[slowdown_mod, compression_mod, secure_mod, elastic_mod, scaffold_mod])


def corrected_loop(net, loader, epochs: int, lr: float) -> float:
    """``digitsapp.task.train`` with SCAFFOLD's corrector after each optimizer step."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    correct = scaffold_correction(net, lr)
    net.train()
    total, steps = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            correct()
            total, steps = total + loss.item(), steps + 1
    return total / max(steps, 1)


@app.train()
def handler(msg: Message, context: Context) -> Message:
    if str(context.run_config["strategy"]) == "scaffold":
        example.train_fn = corrected_loop  # the example's own handler, training with the corrected loop
    return train(msg, context)
'''


def bench_app(tmp: Path) -> Path:
    """A copy of the example app with the bench's ServerApp and ClientApp as its components."""
    app = tmp / "app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "digitsapp" / "bench_server_app.py").write_text(SERVER_APP)
    (app / "digitsapp" / "bench_client_app.py").write_text(CLIENT_APP)
    pyproject = (app / "pyproject.toml").read_text()
    for old, new in (('"digitsapp.server_app:app"', '"digitsapp.bench_server_app:app"'),
                     ('"digitsapp.client_app:app"', '"digitsapp.bench_client_app:app"')):
        if old not in pyproject:
            raise SystemExit(f"examples/flower-app/pyproject.toml no longer names {old}")
        pyproject = pyproject.replace(old, new)
    pyproject = pyproject.replace("[tool.flwr.app.config]\n", '[tool.flwr.app.config]\nstrategy = "fedavg"\n'
                                  'concurrency = 16\nbuffer = 8\nstragglers = "none"\ndp = "none"\n')
    (app / "pyproject.toml").write_text(pyproject)
    return app


def run_app(app: Path, args: argparse.Namespace, strategy: str, tmp: Path, downlink: str = "none",
            dp: str = "none") -> dict:
    """The user's app on Flower's simulation engine, one Ray actor per client; ``dp``: distributed DP
    for the ``secure`` strategy."""
    home, results = tmp / f"home-{strategy}", tmp / f"{strategy}.json"
    config = {"num-server-rounds": args.rounds, "local-epochs": args.local_epochs, "lr": args.lr,
              "dirichlet-alpha": args.alpha, "uplink": args.codec, "downlink": downlink, "start": "",
              "strategy": strategy, "concurrency": args.clients, "buffer": max(1, args.clients // 2),
              "stragglers": args.stragglers, "dp": dp, "results": str(results)}
    started = time.monotonic()
    env = flower_environment(home)
    with ProcessGroup(tmp / f"logs-{strategy}", env=env, also_match={"FLWR_HOME": str(home)}) as group:
        flower = FlowerLaunch(group, home, isolation="subprocess")
        flower.start_superlink(simulation=True, cwd=tmp)
        federation = {"num-supernodes": args.clients, "client-resources-num-cpus": 1,
                      "init-args-num-cpus": args.clients}
        runner = flower.submit(app, config, federation_config=federation, cwd=tmp)
        flower.follow(runner, time.monotonic() + args.timeout)
        if runner.popen.returncode != 0:
            raise SystemExit(f"app {strategy}: flwr run failed:\n{runner.log_tail(40)}")
    data = json.loads(results.read_text())
    timeline = data["timeline"]
    accuracy = [a for _, a, _ in timeline[1:]]  # version 0 is the initial model
    elapsed = [s for _, _, s in timeline[1:]]
    return {"side": "your Flower app", "label": strategy, "versions": len(accuracy), "accuracy": accuracy,
            "elapsed": elapsed, "time_to_target": time_to(args.target, accuracy, elapsed),
            "final_accuracy": accuracy[-1], "best_accuracy": max(accuracy), "wall_seconds": time.monotonic() - started,
            "train_metrics": data["train"]}


def run_engine(args: argparse.Namespace, label: str, algorithm: str, tmp: Path) -> dict:
    engine_args = argparse.Namespace(clients=args.clients, rounds=args.rounds, local_epochs=args.local_epochs,
                                     partitioning=f"dirichlet:alpha={args.alpha}", engine="simulation",
                                     target=args.target, overrides={"stragglers": args.stragglers})
    result = run_one(label, algorithm, args.codec, engine_args, args.seed, tmp)
    return {"side": "Fedge's engine", **{k: result[k] for k in ("label", "versions", "accuracy", "elapsed",
                                                                   "time_to_target", "final_accuracy",
                                                                   "best_accuracy", "wall_seconds")}}


def main() -> int:
    stop_on_sigterm()  # a killed benchmark stops every process it started
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    app_arguments(parser, clients=16, local_epochs=5, rounds_help="synchronous rounds; FedBuff publishes "
                  "rounds x clients / buffer versions (the same client work)")
    parser.add_argument("--codec", default="qsgd:bits=4")
    parser.add_argument("--stragglers", default="fraction=0.25,slowdown=5")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=42, help="the engine's seed (the app seeds its own split)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "flower-stragglers"))
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/flower_stragglers.py", *sys.argv[1:]])
    buffer = max(1, args.clients // 2)
    runs = []
    with tempfile.TemporaryDirectory(prefix="fedge-bench-flower-stragglers-") as tmp_name:
        tmp = Path(tmp_name)
        app = bench_app(tmp)
        for strategy in ("fedavg", "fedbuff"):
            print(f"== your Flower app: {strategy}", flush=True)
            runs.append(run_app(app, args, strategy, tmp))
        fedbuff = f"fedbuff:concurrency={args.clients},buffer={buffer}"
        for label, algorithm in (("fedavg", "fedavg"), ("fedbuff", fedbuff)):
            print(f"== Fedge's engine: {label}", flush=True)
            runs.append(run_engine(args, label, algorithm, tmp))
    speedups = {}
    for side in ("your Flower app", "Fedge's engine"):
        sync, fedbuff = (next(r for r in runs if r["side"] == side and r["label"] == label)
                         for label in ("fedavg", "fedbuff"))
        if sync["time_to_target"] and fedbuff["time_to_target"]:
            speedups[side] = sync["time_to_target"] / fedbuff["time_to_target"]
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()}: {args.clients} clients, "
             f"Dirichlet({args.alpha}), {args.codec}, {args.local_epochs} local epochs, stragglers {args.stragglers}, "
             f"{args.rounds} rounds = {args.rounds * args.clients // buffer} FedBuff versions of {buffer}, "
             f"Flower's simulation engine; `{command}`", "",
             f"| side | run | versions | final acc | best acc | time to {100 * args.target:g}% | speed-up | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        t = r["time_to_target"]
        speed = speedups.get(r["side"]) if r["label"] == "fedbuff" else (1.0 if r["side"] in speedups else None)
        lines.append(f"| {r['side']} | {r['label']} | {r['versions']} | {100 * r['final_accuracy']:.2f}% | "
                     f"{100 * r['best_accuracy']:.2f}% | {'never' if t is None else f'{t:.0f} s'} | "
                     f"{'-' if speed is None else f'{speed:.2f}x'} | {r['wall_seconds']:.0f} |")
    if len(speedups) == 2:
        ratio = speedups["your Flower app"] / speedups["Fedge's engine"]
        lines += ["", f"FedBuff's speed-up from your app is {ratio:.2f} of the engine's (goal: within 20%, "
                  f"0.80-1.20): {'met' if 0.8 <= ratio <= 1.2 else 'NOT met'}."]
    text = "\n".join(lines)
    report(args.out, text, {"command": command, "runs": runs, "speedups": speedups})
    return 0


if __name__ == "__main__":
    sys.exit(main())
