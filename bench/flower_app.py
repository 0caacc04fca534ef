"""A Flower app with and without Fedge, side by side: ``examples/flower-app`` as Flower wrote it
(docs/flower.md's four lines taken back out) and as it is, on Flower's simulation engine, same
seed, same data split, same rounds, in one invocation. ``--seeds``: each seed draws the start model,
the data split and the local shuffles; both apps run every seed, so their final accuracies pair by
seed (mean difference and its 95% interval; one inside its interval is "no measurable difference").
``--app fashion``: a second Flower app written with the same four Fedge lines (``bench/flower_fashion``:
Fashion-MNIST from Debian's ``dataset-fashion-mnist``, a LeNet-style CNN), to check a setting on an
app it was not chosen on.

Reported per run: the server's held-out accuracy (its ``evaluate_fn``) after the last round and
its best, and the bytes each way: with Fedge, the wrapper's ``fedge-uplink-bytes`` (the update
records received, as Flower serializes them) and ``fedge-downlink-bytes`` (the model records sent:
fp32 arrays, or the lattice change, start model and raw arrays); without, the replies Flower
reports receiving (``aggregate_train: Received N results``, from the run's log) times the fp32
``ArrayRecord`` of the model as Flower serializes it (every array's bytes, .npy headers included),
and as many messages down (every train message carries the model; fraction-train 1).

    .venv/bin/python bench/flower_app.py --repeats 3                         # 10 clients, 30 rounds
    .venv/bin/python bench/flower_app.py --uplinks "qsgd:bits=4;dgc:ratio=0.01,sample=0.05"
    .venv/bin/python bench/flower_app.py --uplinks "qsgd:bits=4;dgc:ratio=0.01,sample=0.05@lattice:ratio=0.05"
    .venv/bin/python bench/flower_app.py --engine deployment --clients 4 --rounds 5 --uplinks "qsgd:bits=4@lattice:ratio=0.05"
    .venv/bin/python bench/flower_app.py --app fashion --seeds 1 2 3 4 5 --workers 2
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedge.launcher.environment import flower_environment  # noqa: E402
from fedge.launcher.processes import ProcessGroup  # noqa: E402
from fedge.launcher.sequence import FlowerLaunch  # noqa: E402
from bench.harness.seeds import client_slots, interval, map_runs, paired, verdict  # noqa: E402
from bench.sigterm import stop_on_sigterm  # noqa: E402
from tests.integration.test_flower_app import APP, plain_flower_app  # noqa: E402

#: --app: the app's directory and its package
APPS = {"digits": (APP, "digitsapp"), "fashion": (ROOT / "bench" / "flower_fashion", "fashionapp")}


def fp32_bytes(app: Path, package: str = "digitsapp") -> int:
    import importlib

    sys.path.insert(0, str(app))
    from flwr.app import ArrayRecord

    import torch

    torch.manual_seed(0)
    net = importlib.import_module(f"{package}.task").Net()
    return sum(len(a.data) for a in ArrayRecord(net.state_dict()).values())


def app_arguments(parser: argparse.ArgumentParser, clients: int = 10, local_epochs: int = 2,
                  rounds_help: str | None = None) -> None:
    """The example app's run: clients, rounds, local epochs, learning rate and the data split (the
    Flower-app benchmarks share them; each its own defaults)."""
    parser.add_argument("--clients", type=int, default=clients)
    parser.add_argument("--rounds", type=int, default=30, help=rounds_help)
    parser.add_argument("--local-epochs", type=int, default=local_epochs)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration over labels")


def report(out: str, text: str, data: dict) -> None:
    """Print the table and write it (``out``.md) with the runs' data (``out``.json, with the command
    in ``data``), then the command that reproduces it."""
    print(text)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".md").write_text(text + "\n")
    path.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"reproduce: {data['command']}")


def run(app: Path, args: argparse.Namespace, spec: str, tmp: Path, name: str, seed: int | None = None,
        package: str = "digitsapp") -> dict:
    """One run; ``spec`` is ``UPLINK[@DOWNLINK]`` for the Fedge app, empty for Flower's. ``seed``
    (the apps of ``APPS``): the run's seed, and the start model the nodes build is that seed's."""
    home, results = tmp / f"home-{name}", tmp / f"{name}.json"
    uplink, _, downlink = spec.partition("@")
    config = {"num-server-rounds": args.rounds, "local-epochs": args.local_epochs, "lr": args.lr,
              "dirichlet-alpha": args.alpha, "uplink": uplink, "results": str(results)}
    if seed is not None:
        config.update({"seed": seed, "start": f"{package}.task:Net@{seed}"})
    if spec:
        config["downlink"] = downlink or "none"
    started = time.monotonic()
    with ProcessGroup(tmp / f"logs-{name}", env=flower_environment(home), also_match={"FLWR_HOME": str(home)}) as group:
        if args.engine == "simulation":
            flower = FlowerLaunch(group, home, isolation="subprocess")
            flower.start_superlink(simulation=True, cwd=tmp)
            federation = {"num-supernodes": args.clients, "client-resources-num-cpus": 1,
                          "init-args-num-cpus": client_slots(getattr(args, "workers", 1))}
        else:  # real SuperNodes on 127.0.0.1 (warm execution), one per client, each with its partition
            flower = FlowerLaunch(group, home, isolation="warm")
            flower.start_superlink(cwd=tmp)
            for i in range(args.clients):
                flower.start_supernode(i, {"partition-id": i, "num-partitions": args.clients}, cwd=tmp)
            federation = None
        runner = flower.submit(app, config, federation_config=federation, cwd=tmp)
        flower.follow(runner, time.monotonic() + args.timeout)
        if runner.popen.returncode != 0:
            raise SystemExit(f"{name}: flwr run failed:\n{runner.log_tail(40)}")
        log = runner.log_path.read_text(errors="replace")
    data = json.loads(results.read_text())
    accuracy = [data["evaluate"][str(r)]["accuracy"] for r in range(args.rounds + 1)]
    received = [int(n) for n in re.findall(r"aggregate_train: Received (\d+) results", log)]
    if len(received) != args.rounds:
        raise SystemExit(f"{name}: found {len(received)} 'Received N results' lines for {args.rounds} rounds")
    fedge = [data["train"][str(r)].get("fedge-uplink-bytes") for r in range(1, args.rounds + 1)]
    down = [data["train"][str(r)].get("fedge-downlink-bytes") for r in range(1, args.rounds + 1)]
    return {"name": name, "seed": seed, "uplink": uplink or "fp32", "downlink": downlink or "fp32",
            "final_accuracy": accuracy[-1],
            "best_accuracy": max(accuracy), "accuracy_per_round": accuracy,  # round 0 (the start model) first
            "replies": sum(received), "seconds": time.monotonic() - started,
            "fedge_uplink_bytes": sum(fedge) if all(v is not None for v in fedge) else None,
            "fedge_downlink_bytes": sum(down) if all(v is not None for v in down) else None}


def _job(job: tuple) -> dict:
    """One run, in a worker process of :func:`map_runs`."""
    app, args, spec, tmp, name, seed, package = job
    result = run(app, args, spec, tmp, name, seed, package)
    print(f"{name}: {100 * result['final_accuracy']:.2f}% in {result['seconds']:.0f} s", flush=True)
    return result


def seeds_lines(columns: list[list[dict]], seeds: list[int]) -> list[str]:
    """Each app's final accuracy over the seeds (every repeat of a seed averaged first) with its 95%
    interval, and the Fedge apps' difference from Flower's paired by seed, with its verdict."""
    def by_seed(column: list[dict]) -> list[float]:
        return [sum(r["final_accuracy"] for r in column if r["seed"] == s) /
                sum(1 for r in column if r["seed"] == s) for s in seeds]

    base = by_seed(columns[0])
    lines = [f"Final held-out accuracy over seeds {seeds} (95% interval, Student t; differences paired by seed "
             "against Flower's app):", ""]
    for i, column in enumerate(columns):
        values = by_seed(column)
        name = "Flower (as written)" if i == 0 else f"with Fedge: {column[0]['uplink']} @ {column[0]['downlink']}"
        line = f"- {name}: {interval(values).text(scale=100, unit='%')}"
        if i:
            line += f"; {verdict(paired(values, base))}"
        lines.append(line)
    return lines


def main() -> int:
    stop_on_sigterm()  # a killed benchmark stops every process it started
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    app_arguments(parser)
    parser.add_argument("--app", choices=sorted(APPS), default="digits",
                        help="examples/flower-app (digits; the setting was chosen on it) or bench/flower_fashion")
    parser.add_argument("--uplinks", default="qsgd:bits=4", help="Fedge uplink codecs to run, one run each, "
                        "separated by ';' (a spec has commas of its own; default: qsgd:bits=4); UPLINK@DOWNLINK "
                        "also sets the downlink, e.g. 'dgc:ratio=0.01,sample=0.05@lattice:ratio=0.05'")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="the runs' seeds (start model, data split, local shuffles); both apps run each")
    parser.add_argument("--repeats", type=int, default=1, help="run every app this many times per seed "
                        "(alternating); the table has the mean over repeats")
    parser.add_argument("--workers", type=int, default=1,
                        help="runs at once, each with its share of the cores (default 1: the wall-time column "
                             "is then one run alone on the machine)")
    parser.add_argument("--engine", choices=("simulation", "deployment"), default="simulation",
                        help="Flower's simulation engine, or a SuperLink with one SuperNode per client")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "flower-app"))
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/flower_app.py", *sys.argv[1:]])
    app, package = APPS[args.app]
    with tempfile.TemporaryDirectory(prefix="fedge-bench-flower-app-") as tmp_name:
        tmp = Path(tmp_name)
        plain = plain_flower_app(app, tmp / "plain-app", package)
        per_reply = fp32_bytes(app, package)
        specs = [s.strip() for s in args.uplinks.split(";") if s.strip()]
        jobs = []
        for seed in args.seeds:
            for repeat in range(args.repeats):
                jobs.append((plain, args, "", tmp, f"flower-s{seed}-{repeat}", seed, package))
                jobs += [(app, args, spec, tmp, f"fedge-{i}-s{seed}-{repeat}", seed, package)
                         for i, spec in enumerate(specs)]
        done = map_runs(_job, jobs, args.workers)
    width = 1 + len(specs)
    repeats = [done[k:k + width] for k in range(0, len(done), width)]
    columns = [list(column) for column in zip(*repeats, strict=True)]
    runs = []
    for column in columns:  # the same app over seeds and repeats: means (accuracy), totals per run (bytes)
        first = dict(column[0])
        first["final_accuracies"] = [r["final_accuracy"] for r in column]
        first["seeds"] = [r["seed"] for r in column]
        first["accuracy_per_round"] = [r["accuracy_per_round"] for r in column]  # one curve per run
        first["final_accuracy"] = sum(first["final_accuracies"]) / len(column)
        first["best_accuracy"] = sum(r["best_accuracy"] for r in column) / len(column)
        first["seconds"] = sum(r["seconds"] for r in column) / len(column)
        if first["fedge_uplink_bytes"] is not None and first["fedge_downlink_bytes"] is not None:
            # index coding depends on the data: every run's total, so the table can give its range
            first["total_bytes_per_run"] = [r["fedge_uplink_bytes"] + r["fedge_downlink_bytes"] for r in column]
        runs.append(first)
    base = runs[0]
    base["uplink_bytes"] = base["replies"] * per_reply
    base["downlink_bytes"] = base["replies"] * per_reply
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()}: {app.relative_to(ROOT)} on "
             f"Flower's {args.engine} engine, {args.clients} clients, {args.rounds} rounds of {args.local_epochs} "
             f"local epochs, Dirichlet({args.alpha}), seeds {args.seeds}, {args.repeats} repeat(s) each, "
             f"{args.workers} run(s) at once (accuracy: the mean over runs; bytes: one run); `{command}`", "",
             *(seeds_lines(columns, args.seeds) if len(args.seeds) > 1 else []), "",
             "| app | uplink | downlink | final accuracy (best) | uplink bytes | fewer than Flower's | "
             "total bytes (up + down) | fewer than Flower's | wall time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        r.setdefault("uplink_bytes", r["fedge_uplink_bytes"])
        r.setdefault("downlink_bytes", r["fedge_downlink_bytes"])
        ratio = base["uplink_bytes"] / r["uplink_bytes"] if r["uplink_bytes"] else float("nan")
        total, base_total = r["uplink_bytes"] + r["downlink_bytes"], base["uplink_bytes"] + base["downlink_bytes"]
        fewer = f"{base_total / total:.2f}x"
        totals = r.get("total_bytes_per_run", [total])
        if max(totals) != min(totals):  # the range over the runs (the bytes column is the first run's)
            fewer += f" ({base_total / max(totals):.2f}-{base_total / min(totals):.2f}x over the runs)"
        lines.append(f"| {'Flower (as written)' if r is base else 'with Fedge (4 lines)'} | {r['uplink']} | "
                     f"{r['downlink']} | {100 * r['final_accuracy']:.2f}% ({100 * r['best_accuracy']:.2f}%; runs "
                     f"{', '.join(f'{100 * a:.2f}' for a in r['final_accuracies'])}) | {r['uplink_bytes']:,} | "
                     f"{ratio:.2f}x | {total:,} | {fewer} | {r['seconds']:.0f} s |")
    report(args.out, "\n".join(lines), {"command": command, "runs": runs, "fp32_reply_bytes": per_reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
