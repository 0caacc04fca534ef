"""Per-round wall time on Flower's deployment engine: Fedge's app against a minimal Flower app.

Both run on the same installation: a real ``flower-superlink`` and N ``flower-supernode`` processes on
127.0.0.1 (one partition each), the app submitted with ``flwr run --stream``, every process stopped
at the end (also on Ctrl-C and SIGTERM). Same model (the digits CNN, 38,282 parameters; checked
before anything starts), same data (scikit-learn digits, stratified 20% held out with seed 42,
evaluated on the server), same local training (SGD, ``--local-epochs`` epochs, batch 32, lr 0.1,
one torch thread per ClientApp), same number of SuperNodes and rounds, every node trains every round.

* **Fedge**: ``fedge.server.local.launch(..., engine="deployment")``, the product's own path, once per
  codec of ``--fedge-codecs``: ``default`` is the product default (4-bit QSGD uplink with error
  feedback), ``none`` sends fp32 updates like the Flower app. ``--partitioning`` (default ``iid``,
  not the product's ``dirichlet:alpha=0.5``) gives Fedge's nodes shards of the same size as the
  Flower app's IID shards, so the slowest node's training time is comparable.
* **Flower**: ``bench/flower_minimal`` (a standalone FAB): ``flwr.serverapp.strategy.FedAvg``
  (fp32 weights, no client evaluation) with a server-side ``evaluate_fn``; a ClientApp that loads
  digits, takes its shard of the pool and trains. Started with Fedge's own process helpers
  (``fedge.launcher.sequence.FlowerLaunch``), the sequence ``launch()`` runs.

Measured per round: its wall time seen by the server (Fedge: a metrics row's ``seconds``, from
sampling nodes to the evaluated model; Flower: the time between consecutive ``evaluate_fn`` calls,
``Strategy.start`` calls it before round 1 too), the slowest client's own training time (optimizer
set-up to the last epoch, measured identically on both sides, reported in the reply), and the
overhead = round - training: message passing, the SuperNode's polling, the ClientApp process each
message starts (imports, data loading), encoding, aggregation, server evaluation. The Flower
app's ClientApp also reports its data loading time and its process's age at the reply, which splits
its round into inside and outside the ClientApp process (printed under the table). Round 1 carries
the warm-up (first ClientApp processes, Fedge's per-run partition cache); it is reported alone and
the medians cover rounds 2..R of every repeat. The JSON also has, per round, the time between a
round's row and the previous one's (Fedge writes a checkpoint after each row, outside its row's
``seconds``; for Flower it is the round time).

    .venv/bin/python bench/deployment_rounds.py                       # 4 rounds, 2 SuperNodes, both Fedge codecs
    .venv/bin/python bench/deployment_rounds.py --rounds 3            # ~3 minutes on 2 idle cores
    .venv/bin/python bench/deployment_rounds.py --repeats 3 --fedge-codecs none
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MINIMAL_APP = Path(__file__).resolve().parent / "flower_minimal"

from fedge.launcher.app_bundle import stage_directory  # noqa: E402
from fedge.launcher.environment import flower_environment  # noqa: E402
from fedge.launcher.processes import ProcessGroup  # noqa: E402
from fedge.launcher.sequence import FlowerLaunch  # noqa: E402
from fedge.server.local import launch  # noqa: E402
from fedge.server.settings import RunSettings  # noqa: E402

_CONNECTION = "flower-minimal"


def check_same_model() -> int:
    """Both apps' models have the same parameter count (the Flower app's is a copy of Fedge's)."""
    from fedge.tasks.digits import DigitsCNN

    sys.path.insert(0, str(MINIMAL_APP))
    try:
        from minimal_app.model import DigitsCNN as MinimalCNN
    finally:
        sys.path.remove(str(MINIMAL_APP))
    fedge = sum(p.numel() for p in DigitsCNN().parameters())
    flower = sum(p.numel() for p in MinimalCNN().parameters())
    if fedge != flower:
        raise SystemExit(f"models differ: Fedge's DigitsCNN has {fedge} parameters, the Flower app's {flower}")
    return fedge


# -- Fedge ------------------------------------------------------------------------------------------
def run_fedge(codec: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    spec = RunSettings().codec if codec == "default" else codec
    settings = RunSettings(
        rounds=args.rounds, local_epochs=args.local_epochs, clients_per_round=args.supernodes,
        partitioning=args.partitioning, codec=spec, run_dir=str(run_dir),
    )

    def show(row: dict[str, Any]) -> None:
        print(f"  round {row['round']}: {row['seconds']:.2f} s, slowest client trained "
              f"{row.get('client_train_seconds', float('nan')):.2f} s, accuracy {row['accuracy']:.4f}", flush=True)

    started = time.monotonic()
    result = launch(settings, engine="deployment", num_supernodes=args.supernodes, on_row=show,
                    isolation=args.fedge_isolation,
                    timeout=args.timeout)
    wall = time.monotonic() - started
    rounds, previous = [], 0.0
    for row in result.rows:
        train = row.get("client_train_seconds")
        rounds.append({
            "round": row["round"], "seconds": row["seconds"], "train_seconds": train,
            "overhead_seconds": None if train is None else row["seconds"] - train,
            "between_rows_seconds": row["wall_seconds"] - previous if row["round"] > 1 else None,
            "accuracy": row["accuracy"], "uplink_bytes": row["uplink_bytes"],
        })
        previous = row["wall_seconds"]
    return {"system": "fedge", "codec": spec, "label": f"Fedge ({'fp32' if spec == 'none' else spec})",
            "rounds": rounds, "run_seconds": wall,
            "settings": {"partitioning": settings.partitioning, "lr": settings.lr, "batch_size": settings.batch_size,
                         "local_epochs": settings.local_epochs, "clients_per_round": settings.clients_per_round}}


# -- the minimal Flower app -------------------------------------------------------------------------
def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return rows


def run_flower(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """SuperLink + SuperNodes + ``flwr run`` of bench/flower_minimal, through the same launch
    sequence as Fedge's ``launch()`` (``fedge.launcher.sequence``)."""
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    flwr_home = run_dir / "flwr-home"
    env = flower_environment(flwr_home)
    out_path = run_dir / "rounds.jsonl"
    out_path.unlink(missing_ok=True)  # the ServerApp appends; a reused --keep directory starts empty
    defaults = RunSettings()
    run_config = {"num-server-rounds": args.rounds, "local-epochs": args.local_epochs, "lr": defaults.lr,
                  "batch-size": defaults.batch_size, "min-nodes": args.supernodes, "out-path": str(out_path)}
    started = time.monotonic()
    group = ProcessGroup(run_dir / "logs", env=env, also_match={"FLWR_HOME": env["FLWR_HOME"]})
    lines: list[dict[str, Any]] = []
    seen = 0

    def show() -> bool:
        nonlocal lines, seen
        lines = _read_lines(out_path)
        for line in lines[seen:]:
            if line["round"] > 0:
                before = lines[line["round"] - 1]["time"]
                print(f"  round {line['round']}: {line['time'] - before:.2f} s, slowest client trained "
                      f"{line['train_seconds']:.2f} s, accuracy {line['accuracy']:.4f}", flush=True)
        seen = len(lines)
        return False

    try:
        # the Flower app as its users run it: Flower's default (a new ClientApp process per message)
        flower = FlowerLaunch(group, flwr_home, _CONNECTION, isolation=args.flower_isolation)
        flower.start_superlink(cwd=run_dir)
        for i in range(args.supernodes):
            flower.start_supernode(i, {"partition-id": i, "num-partitions": args.supernodes}, cwd=run_dir)
        runner = flower.submit(stage_directory(flwr_home / "app", MINIMAL_APP), run_config, cwd=run_dir)
        flower.follow(runner, started + args.timeout, show)
        if runner.popen.returncode != 0 or len(lines) != args.rounds + 1:
            raise RuntimeError(f"the Flower run failed (flwr run exit code {runner.popen.returncode}, "
                               f"{len(lines)} of {args.rounds + 1} evaluations); logs in {run_dir / 'logs'}:\n"
                               f"{runner.log_tail(30)}")
    finally:
        group.stop()
    wall = time.monotonic() - started
    rounds = []
    for before, line in zip(lines, lines[1:]):
        seconds = line["time"] - before["time"]
        rounds.append({
            "round": line["round"], "seconds": seconds, "train_seconds": line["train_seconds"],
            "overhead_seconds": seconds - line["train_seconds"],
            "between_rows_seconds": seconds if line["round"] > 1 else None,
            "accuracy": line["accuracy"],
            "evaluate_seconds": line["evaluate_seconds"], "slowest_process": line.get("slowest_process"),
        })
    return {"system": "flower", "codec": "none", "label": "Flower FedAvg (fp32)", "rounds": rounds,
            "run_seconds": wall,
            "settings": {"partitioning": "iid", "lr": defaults.lr, "batch_size": defaults.batch_size,
                         "local_epochs": args.local_epochs, "clients_per_round": args.supernodes}}


# -- summary ----------------------------------------------------------------------------------------
def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per system (label): medians over rounds 2..R of every repeat, round 1 alone."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        entry = out.setdefault(run["label"], {"label": run["label"], "system": run["system"], "codec": run["codec"],
                                              "runs": []})
        entry["runs"].append(run)
    for entry in out.values():
        later = [r for run in entry["runs"] for r in run["rounds"] if r["round"] > 1]
        first = [r for run in entry["runs"] for r in run["rounds"] if r["round"] == 1]
        entry.update({
            "repeats": len(entry["runs"]),
            "round1_seconds": _median([r["seconds"] for r in first]),
            "round_seconds": _median([r["seconds"] for r in later]),
            "between_rows_seconds": _median([r["between_rows_seconds"] for r in later]),
            "train_seconds": _median([r["train_seconds"] for r in later]),
            "overhead_seconds": _median([r["overhead_seconds"] for r in later]),
            "final_accuracy": _median([run["rounds"][-1]["accuracy"] for run in entry["runs"]]),
            "run_seconds": _median([run["run_seconds"] for run in entry["runs"]]),
            # Flower app only: the longest-lived ClientApp process of each round, split by its reply
            "slowest_process": {key: _median([(r.get("slowest_process") or {}).get(key) for r in later])
                                for key in ("process-seconds", "data-seconds", "train-seconds")},
        })
    flower = next((e for e in out.values() if e["system"] == "flower"), None)
    for entry in out.values():
        base = flower and flower["overhead_seconds"]
        mine = entry["overhead_seconds"]
        entry["overhead_vs_flower"] = mine / base if base and mine is not None else None
    return list(out.values())


def contended_rounds(runs: list[dict[str, Any]], factor: float = 1.5) -> list[str]:
    """Rounds whose slowest client trained ``factor`` x longer than the median round of the same
    system: a system's training work is identical each round, so a long one means something else held
    the CPUs. (Per system: the systems differ; Flower's app builds a ``torch.optim.SGD``, which
    imports ``torch._dynamo`` inside its timed training, Fedge's does not.)"""
    medians = {label: _median([r["train_seconds"] for run in runs if run["label"] == label for r in run["rounds"]])
               for label in {run["label"] for run in runs}}
    return [f"{run['label']} round {r['round']} ({r['train_seconds']:.2f} s vs {medians[run['label']]:.2f} s)"
            for run in runs for r in run["rounds"]
            if medians[run["label"]] and r["train_seconds"] is not None
            and r["train_seconds"] > factor * medians[run["label"]]]


def table(summary: list[dict[str, Any]]) -> str:
    def num(value: float | None, fmt: str = ".2f") -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        "| system | round 1 s | round s (median r2..R) | slowest client train s | overhead s (round - train) | "
        "overhead vs Flower | final acc | whole run s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in summary:
        ratio = "-" if e["overhead_vs_flower"] is None else f"{e['overhead_vs_flower']:.2f}x"
        acc = "-" if e["final_accuracy"] is None else f"{100 * e['final_accuracy']:.2f}%"
        lines.append(
            f"| {e['label']} | {num(e['round1_seconds'])} | {num(e['round_seconds'])} | {num(e['train_seconds'])} | "
            f"{num(e['overhead_seconds'])} | {ratio} | {acc} | "
            f"{num(e['run_seconds'], '.0f')} |"
        )
    return "\n".join(lines)


def breakdown(summary: list[dict[str, Any]]) -> str:
    """Where the Flower app's rounds go (medians over rounds 2..R of each round's largest values):
    its ClientApp reports how long its process had lived when the reply was built."""
    lines = []
    for e in summary:
        split = e["slowest_process"]
        life, data, train = split["process-seconds"], split["data-seconds"], split["train-seconds"]
        if None in (life, data, train, e["round_seconds"]):
            continue
        lines.append(
            f"{e['label']}: longest ClientApp process, start to reply {life:.2f} s = start-up and imports "
            f"{life - data - train:.2f} s + data loading (scikit-learn import included) {data:.2f} s + training "
            f"{train:.2f} s; outside the process {e['round_seconds'] - life:.2f} s (SuperNode and SuperExec "
            f"polling, SuperLink messaging, the ServerApp's 3 s pull interval, aggregation, evaluation)."
        )
    return "\n".join(lines)


def print_table(summary: list[dict[str, Any]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(table(summary))
        return
    rows = [line.strip("|").split(" | ") for line in table(summary).splitlines()]
    view = Table(title="per-round wall time on the deployment engine")
    for name in rows[0]:
        view.add_column(name.strip(), justify="left" if name.strip() == "system" else "right")
    for cells in rows[2:]:
        view.add_row(*(c.strip() for c in cells))
    Console(width=200).print(view)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    # SIGTERM unwinds like Ctrl-C: launch() and run_flower() stop every Flower process they started.
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run (>= 2: round 1 is warm-up)")
    parser.add_argument("--supernodes", type=int, default=2)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--fedge-codecs", default="none,default",
                        help="comma-separated Fedge uplink codecs: 'default' (the product default, "
                        f"{RunSettings().codec}), 'none' (fp32), or any codec spec; empty = Flower only")
    parser.add_argument("--partitioning", default="iid",
                        help="Fedge's partitioning (the Flower app always shards IID)")
    parser.add_argument("--no-flower", action="store_true", help="run only Fedge")
    parser.add_argument("--fedge-isolation", default="warm", choices=("warm", "subprocess"),
                        help="Fedge's SuperNodes (default: warm, the product default)")
    parser.add_argument("--flower-isolation", default="subprocess", choices=("warm", "subprocess"),
                        help="the Flower app's SuperNodes (default: subprocess, Flower's own default)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is abandoned")
    parser.add_argument("--keep", metavar="DIR", help="keep run directories (logs, metrics) under DIR")
    parser.add_argument("--out", help="output path without suffix (default: bench/results/deployment-rounds)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 is warm-up, reported on its own)")
    if args.supernodes < 1 or args.repeats < 1 or args.local_epochs < 1:
        parser.error("--supernodes, --repeats and --local-epochs must be >= 1")
    # a codec spec has commas of its own ('qsgd:bits=4,bucket=512'): a part without ':' that holds
    # '=' continues the previous spec
    codecs: list[str] = []
    for part in (p.strip() for p in args.fedge_codecs.split(",") if p.strip()):
        if codecs and "=" in part and ":" not in part:
            codecs[-1] += "," + part
        else:
            codecs.append(part)
    numel = check_same_model()
    command = shlex.join([".venv/bin/python", "bench/deployment_rounds.py", *sys.argv[1:]])
    machine = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
               "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
               "load_average_at_start": os.getloadavg()}
    from importlib.metadata import version

    machine["flwr"], machine["torch"] = version("flwr"), version("torch")

    base = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="fedge-bench-deployment-"))
    runs: list[dict[str, Any]] = []
    ok = False
    try:
        for repeat in range(args.repeats):
            for index, codec in enumerate(codecs):
                print(f"== Fedge, codec {codec} (repeat {repeat + 1}/{args.repeats})", flush=True)
                # a fresh directory per run: launch() resumes from a checkpoint it finds
                run = run_fedge(codec, args, base / f"fedge-{index}-{codec.split(':')[0]}-{repeat}")
                runs.append({**run, "repeat": repeat})
            if not args.no_flower:
                print(f"== minimal Flower app (repeat {repeat + 1}/{args.repeats})", flush=True)
                runs.append({**run_flower(args, base / f"flower-{repeat}"), "repeat": repeat})
        ok = True
    finally:
        if not args.keep:
            if ok:
                shutil.rmtree(base, ignore_errors=True)
            else:
                print(f"run directories (logs) kept in {base}", file=sys.stderr)

    summary = summarize(runs)
    machine["load_average_at_end"] = os.getloadavg()
    header = (
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {machine['processor']}, {machine['cpu_count']} logical CPUs "
        f"({machine['platform']}; load average {machine['load_average_at_start'][0]:.2f} at start, "
        f"{machine['load_average_at_end'][0]:.2f} at end): Flower {machine.get('flwr', '?')} deployment engine, "
        f"{args.supernodes} SuperNodes on 127.0.0.1, {args.rounds} rounds of {args.local_epochs} local epochs, "
        f"digits CNN ({numel:,} parameters), {args.repeats} repeat(s); Fedge partitioning {args.partitioning}. "
        f"Medians over rounds 2..{args.rounds}; overhead = round - slowest client's training.\n\n"
        f"`{command}`"
    )
    contended = contended_rounds(runs)
    if contended:
        header += ("\n\n**Rounds whose slowest client trained 1.5x longer than that system's median round** (the same work "
                   "every round: another process was taking the CPUs): " + "; ".join(contended) + ".")
    if machine["load_average_at_start"][0] >= 0.5 * (os.cpu_count() or 1):
        header += ("\n\n**Other processes were using the CPUs when this run started** (load average): "
                   "training and start-up times are inflated and the comparison is noisy; repeat on an idle machine.")
    print()
    print(header)
    print_table(summary)
    notes = breakdown(summary)
    if notes:
        print(notes)
    out = Path(args.out or Path(__file__).parent / "results" / "deployment-rounds")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(header + "\n\n" + table(summary) + "\n" + (f"\n{notes}\n" if notes else ""))
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
         "parameters": numel, "args": {k: v for k, v in vars(args).items()},
         "summary": [{k: v for k, v in e.items() if k != "runs"} for e in summary], "runs": runs},
        indent=2) + "\n")
    print(f"reproduce: {command}")
    print(f"wrote {out}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
