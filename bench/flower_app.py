"""A Flower app with and without Fedge, side by side: ``examples/flower-app`` as Flower wrote it
(docs/flower.md's four lines taken back out) and as it is, on Flower's simulation engine, same
seed, same data split, same rounds, one after the other in one invocation.

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
from tests.integration.test_flower_app import APP, plain_flower_app  # noqa: E402


def fp32_bytes(app: Path) -> int:
    sys.path.insert(0, str(app))
    from flwr.app import ArrayRecord

    from digitsapp.task import Net  # type: ignore[import-not-found]

    import torch

    torch.manual_seed(0)
    return sum(len(a.data) for a in ArrayRecord(Net().state_dict()).values())


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


def run(app: Path, args: argparse.Namespace, spec: str, tmp: Path, name: str) -> dict:
    """One run; ``spec`` is ``UPLINK[@DOWNLINK]`` for the Fedge app, empty for Flower's."""
    home, results = tmp / f"home-{name}", tmp / f"{name}.json"
    uplink, _, downlink = spec.partition("@")
    config = {"num-server-rounds": args.rounds, "local-epochs": args.local_epochs, "lr": args.lr,
              "dirichlet-alpha": args.alpha, "uplink": uplink, "results": str(results)}
    if spec:
        config["downlink"] = downlink or "none"
    started = time.monotonic()
    with ProcessGroup(tmp / f"logs-{name}", env=flower_environment(home), also_match={"FLWR_HOME": str(home)}) as group:
        if args.engine == "simulation":
            flower = FlowerLaunch(group, home, isolation="subprocess")
            flower.start_superlink(simulation=True, cwd=tmp)
            federation = {"num-supernodes": args.clients, "client-resources-num-cpus": 1, "init-args-num-cpus": 2}
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
    return {"name": name, "uplink": uplink or "fp32", "downlink": downlink or "fp32", "final_accuracy": accuracy[-1],
            "best_accuracy": max(accuracy), "accuracy_per_round": accuracy,  # round 0 (the start model) first
            "replies": sum(received), "seconds": time.monotonic() - started,
            "fedge_uplink_bytes": sum(fedge) if all(v is not None for v in fedge) else None,
            "fedge_downlink_bytes": sum(down) if all(v is not None for v in down) else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    app_arguments(parser)
    parser.add_argument("--uplinks", default="qsgd:bits=4", help="Fedge uplink codecs to run, one run each, "
                        "separated by ';' (a spec has commas of its own; default: qsgd:bits=4); UPLINK@DOWNLINK "
                        "also sets the downlink, e.g. 'dgc:ratio=0.01,sample=0.05@lattice:ratio=0.05'")
    parser.add_argument("--repeats", type=int, default=1, help="run every app this many times (alternating); "
                        "the table has the mean over repeats")
    parser.add_argument("--engine", choices=("simulation", "deployment"), default="simulation",
                        help="Flower's simulation engine, or a SuperLink with one SuperNode per client")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "flower-app"))
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/flower_app.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory(prefix="fedge-bench-flower-app-") as tmp_name:
        tmp = Path(tmp_name)
        plain = plain_flower_app(APP, tmp / "plain-app")
        per_reply = fp32_bytes(APP)
        specs = [s.strip() for s in args.uplinks.split(";") if s.strip()]
        repeats: list[list[dict]] = []
        for repeat in range(args.repeats):
            one = [run(plain, args, "", tmp, f"flower-{repeat}")]
            one += [run(APP, args, spec, tmp, f"fedge-{i}-{repeat}") for i, spec in enumerate(specs)]
            repeats.append(one)
    runs = []
    for column in zip(*repeats, strict=True):  # the same app over the repeats: means (accuracy), totals per run (bytes)
        first = dict(column[0])
        first["final_accuracies"] = [r["final_accuracy"] for r in column]
        first["accuracy_per_round"] = [r["accuracy_per_round"] for r in column]  # one curve per repeat
        first["final_accuracy"] = sum(first["final_accuracies"]) / len(column)
        first["best_accuracy"] = sum(r["best_accuracy"] for r in column) / len(column)
        first["seconds"] = sum(r["seconds"] for r in column) / len(column)
        if first["fedge_uplink_bytes"] is not None and first["fedge_downlink_bytes"] is not None:
            # index coding depends on the data: every repeat's total, so the table can give its range
            first["total_bytes_per_run"] = [r["fedge_uplink_bytes"] + r["fedge_downlink_bytes"] for r in column]
        runs.append(first)
    base = runs[0]
    base["uplink_bytes"] = base["replies"] * per_reply
    base["downlink_bytes"] = base["replies"] * per_reply
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()}: examples/flower-app on Flower's "
             f"{args.engine} engine, {args.clients} clients, {args.rounds} rounds of {args.local_epochs} local epochs, "
             f"Dirichlet({args.alpha}), {args.repeats} repeat(s) (accuracy: their mean; bytes: one run); "
             f"`{command}`", "",
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
        if max(totals) != min(totals):  # the range over the repeats (the bytes column is the first run's)
            fewer += f" ({base_total / max(totals):.2f}-{base_total / min(totals):.2f}x over the runs)"
        lines.append(f"| {'Flower (as written)' if r is base else 'with Fedge (4 lines)'} | {r['uplink']} | "
                     f"{r['downlink']} | {100 * r['final_accuracy']:.2f}% ({100 * r['best_accuracy']:.2f}%; runs "
                     f"{', '.join(f'{100 * a:.2f}' for a in r['final_accuracies'])}) | {r['uplink_bytes']:,} | "
                     f"{ratio:.2f}x | {total:,} | {fewer} | {r['seconds']:.0f} s |")
    report(args.out, "\n".join(lines), {"command": command, "runs": runs, "fp32_reply_bytes": per_reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
