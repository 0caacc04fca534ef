"""NIID-Bench's Fashion-MNIST table (Li, Diao, Chen, He, ICDE 2022, arXiv 2102.02079), cell by cell.

Its setting, as in its repository and in Flower's ``baselines/niid_bench``: 10 clients, all in every
round, 50 rounds of 10 local epochs, batch 64, SGD lr 0.01 with momentum 0.9, its ``simple-cnn``
(``fashion:model=simple-cnn``), FedProx mu 0.01; the figure is the best held-out accuracy over the
rounds (the 10,000 test images). A cell is one (algorithm, partition, codec, seed):

* algorithms: ``fedavg``, ``fedprox`` (FedAvg with prox-mu), ``scaffold``, ``fednova``; ``fedavg-wd`` and
  ``fednova-wd`` train with the weight decay of Flower's baseline (1e-5; the other cells have none);
* partitions: ``iid``, ``dir0.5`` (Dirichlet(0.5) label skew), ``c2``/``c3`` (#C=k labels per client,
  sort and partition: ``pathological:classes=k``), ``c2draw1``..``c2draw3`` (#C=2 from other draws of
  the split: its partitioner's seed 1, 2 or 3, where ``c2`` is seed 42);
* codecs: ``fp32`` (the table's own setting), ``default`` (Fedge's default uplink codec, fp32 model
  down), ``dgc`` (DGC 1% + 4-bit QSGD with error feedback up; down, the lattice setting Fedge's
  both-directions results chose and confirmed on other seeds and another app: 5% of coordinates a
  version, up to 127 steps of 1/32 of a tensor's initial RMS, 20% for the first 6 versions) and
  ``dgclat1`` (the same uplink with a 1%, 4-bit lattice down: a version moves a coordinate at most 7
  steps of 1/256 RMS, so the devices' copy cannot follow the model; kept as the measured failure).

Every finished cell is one JSON file under ``--out``/cells (written atomically); a cell already there
is not run again, and a cell killed half-way resumes from its run directory's checkpoint (under
``--runs``), so the table fills in over several sittings. Cells run side by side, one process per core,
each with one torch thread and its share of the cores as Ray actors. ``table`` (or any run) rewrites
``niid-bench.md`` from the cells present: Fedge's best accuracy (mean ± 95% interval over seeds) beside
the published mean ± std, and for compressed cells the bytes both ways and the accuracy difference
against fp32, paired by seed.

    .venv/bin/python bench/niid_bench.py run --algorithms fedavg --partitions dir0.5 --seeds 1 2 3
    .venv/bin/python bench/niid_bench.py run --algorithms fedavg fedprox scaffold fednova --partitions dir0.5 c2
    .venv/bin/python bench/niid_bench.py run --algorithms fedavg --partitions dir0.5 c2 --codecs default dgc
    .venv/bin/python bench/niid_bench.py table
    .venv/bin/python bench/niid_bench.py run --smoke     # 2 rounds of 1 epoch on 2,000 images: the path works
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fedge.deploy.atomic import atomic_write_text
from fedge.server.local import launch
from fedge.server.settings import RunSettings
from fedge.tasks import fashion_mnist

from bench.harness.seeds import client_slots, default_workers, interval, map_runs, paired, verdict

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "niid-bench"

ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {"algorithm": "fedavg"},
    "fedprox": {"algorithm": "fedavg", "prox_mu": 0.01},
    "scaffold": {"algorithm": "scaffold"},
    "fednova": {"algorithm": "fednova"},
    # the same, with the weight decay Flower's baseline trains every algorithm with (Fedge's cells: none)
    "fedavg-wd": {"algorithm": "fedavg", "weight_decay": 1e-5},
    "fednova-wd": {"algorithm": "fednova", "weight_decay": 1e-5},
}
PARTITIONS = {
    "iid": "iid",
    "dir0.5": "dirichlet:alpha=0.5",
    "c2": "pathological:classes=2",
    "c3": "pathological:classes=3",
    # #C=2 from other draws of its split (the partitioner's seed; ``c2`` is its default draw, 42): how
    # much a cell owes to which labels the draw gave each client, and so to the clients' sizes
    "c2draw1": "pathological:classes=2,seed=1",
    "c2draw2": "pathological:classes=2,seed=2",
    "c2draw3": "pathological:classes=2,seed=3",
}
CODECS: dict[str, dict[str, Any]] = {
    "fp32": {"codec": "none", "downlink_codec": "none"},
    "default": {"codec": RunSettings().codec, "downlink_codec": "none"},
    "dgc": {"codec": "dgc:ratio=0.01,sample=0.05+qsgd:bits=4",
            "downlink_codec": "lattice:ratio=0.05,bits=8,resolution=32,warmup=6,dense=0.2"},
    "dgclat1": {"codec": "dgc:ratio=0.01,sample=0.05+qsgd:bits=4", "downlink_codec": "lattice:ratio=0.01,bits=4"},
}
# Flower's baselines/niid_bench README, "Expected Results" (Fashion-MNIST): mean, std
PUBLISHED: dict[tuple[str, str], tuple[float, float]] = {
    ("fedavg", "iid"): (89.23, 0.45), ("scaffold", "iid"): (89.33, 0.27),
    ("fedprox", "iid"): (89.42, 0.09), ("fednova", "iid"): (89.36, 0.09),
    ("fedavg", "dir0.5"): (88.09, 0.29), ("scaffold", "dir0.5"): (88.44, 0.25),
    ("fedprox", "dir0.5"): (88.15, 0.42), ("fednova", "dir0.5"): (88.22, 0.12),
    ("fedavg", "c2"): (78.10, 2.51), ("scaffold", "c2"): (33.80, 41.22),
    ("fedprox", "c2"): (78.05, 0.99), ("fednova", "c2"): (71.67, 2.34),
    ("fedavg", "c3"): (82.43, 1.52), ("scaffold", "c3"): (80.32, 5.03),
    ("fedprox", "c3"): (82.99, 0.48), ("fednova", "c3"): (81.97, 1.34),
}
TABLE = {"clients": 10, "rounds": 50, "local_epochs": 10, "batch_size": 64, "lr": 0.01, "momentum": 0.9}
SMOKE = {"clients": 4, "rounds": 2, "local_epochs": 1, "batch_size": 64, "lr": 0.01, "momentum": 0.9,
         "train_samples": 2000, "test_samples": 500}


def cell_name(algorithm: str, partition: str, codec: str, seed: int) -> str:
    return f"{algorithm}-{partition}-{codec}-s{seed}"


def parse_cell(name: str, parser: argparse.ArgumentParser) -> tuple[str, str, str, int]:
    """``fedavg-c2-fp32-s1`` -> ("fedavg", "c2", "fp32", 1); an unknown part is a usage error."""
    parts = name.rsplit("-", 3)
    if (len(parts) != 4 or parts[0] not in ALGORITHMS or parts[1] not in PARTITIONS or parts[2] not in CODECS
            or not parts[3].startswith("s") or not parts[3][1:].isdigit()):
        parser.error(f"--cell {name!r}: ALGORITHM-PARTITION-CODEC-sSEED with algorithm in {list(ALGORITHMS)}, "
                     f"partition in {list(PARTITIONS)}, codec in {list(CODECS)}")
    return parts[0], parts[1], parts[2], int(parts[3][1:])


def cell_settings(algorithm: str, partition: str, codec: str, seed: int, setup: dict[str, Any],
                  run_dir: Path) -> RunSettings:
    """The run settings of one cell: the table's setting, the algorithm's and the codec's."""
    samples = "".join(f",{key}={setup[key]}" for key in ("train_samples", "test_samples")
                      if key in setup)
    return RunSettings(
        task=f"fashion:model=simple-cnn{samples}", partitioning=PARTITIONS[partition], seed=seed,
        rounds=setup["rounds"], clients_per_round=setup["clients"], local_epochs=setup["local_epochs"],
        batch_size=setup["batch_size"], lr=setup["lr"], momentum=setup["momentum"], run_dir=str(run_dir),
        **ALGORITHMS[algorithm], **CODECS[codec],
    )


def run_cell_or_report(job: tuple[str, str, str, int, dict[str, Any], str, str, int, str]) -> dict[str, Any]:
    """:func:`run_cell`, a failure reported (the other cells go on; a later ``run`` retries it)."""
    try:
        return run_cell(job)
    except Exception as err:  # noqa: BLE001 - one cell's failure is printed, the table goes on
        name = cell_name(*job[:4])
        print(f"== {name}: FAILED ({type(err).__name__}: {err}); run again to retry it", flush=True)
        return {"cell": name, "error": f"{type(err).__name__}: {err}"}


def run_cell(job: tuple[str, str, str, int, dict[str, Any], str, str, int, str]) -> dict[str, Any]:
    """One cell on the simulation engine; its JSON (with ``command``, the invocation that ran it) is
    written before this returns (atomically)."""
    algorithm, partition, codec, seed, setup, runs, out, slots, command = job
    name = cell_name(algorithm, partition, codec, seed)
    settings = cell_settings(algorithm, partition, codec, seed, setup, Path(runs) / name)
    started = time.monotonic()
    result = launch(settings, engine="simulation", num_supernodes=setup["clients"], timeout=4 * 3600,
                    parallel_clients=slots)
    rows = result.rows
    if len(rows) < setup["rounds"]:
        raise RuntimeError(f"{name}: {len(rows)} of {setup['rounds']} rounds written (see {result.run_dir})")
    accuracy = [r["accuracy"] for r in rows]
    cell = {
        "cell": name, "algorithm": algorithm, "partition": partition, "codec": codec, "seed": seed,
        "settings": {key: str(value) for key, value in vars(settings).items() if key != "run_dir"},
        "best_accuracy": max(accuracy), "final_accuracy": accuracy[-1],
        "best_round": accuracy.index(max(accuracy)) + 1, "accuracy": accuracy,
        "uplink_bytes": sum(r["uplink_bytes"] for r in rows),
        "uplink_fp32_bytes": sum(r["uplink_fp32_bytes"] for r in rows),
        "downlink_bytes": sum(r["downlink_bytes"] for r in rows),
        "rejected": sum(len(r.get("rejected") or []) for r in rows),
        "wall_seconds_this_sitting": time.monotonic() - started,
        # a cell killed and resumed continues from its checkpoint; SCAFFOLD's devices then restart
        # from c_i = 0 (their state lived in the killed processes), as new devices would
        "resumed_from_round": (result.summary or {}).get("resumed_from_round"),
        "round_seconds": sum(r["seconds"] for r in rows) / len(rows),
        "measured": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "command": command,
    }
    path = Path(out) / "cells" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(cell, indent=2) + "\n")
    print(f"== {name}: best {100 * cell['best_accuracy']:.2f}% (round {cell['best_round']}), "
          f"final {100 * cell['final_accuracy']:.2f}%", flush=True)
    return cell


def load_cells(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))]


def _published_figure(algorithm: str, partition: str) -> tuple[float, float]:
    """The published mean and std of a cell (another draw of a split, or the baseline's weight decay,
    is set against the cell the table publishes)."""
    return PUBLISHED[(algorithm.split("-wd")[0], partition.split("draw")[0])]


def _published(algorithm: str, partition: str) -> str:
    mean, std = _published_figure(algorithm, partition)
    return f"{mean:.2f} ± {std:.2f}"


def _within(value: float, algorithm: str, partition: str) -> str:
    mean, std = _published_figure(algorithm, partition)
    return "yes" if abs(100 * value - mean) <= 2 * std else f"no ({100 * value - mean:+.2f})"


def table(cells: list[dict[str, Any]]) -> str:
    """The accuracy table (fp32 cells) and the compression table (paired by seed against fp32)."""
    by: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for c in cells:
        by.setdefault((c["algorithm"], c["partition"], c["codec"]), {})[c["seed"]] = c
    lines = [("| partition | algorithm | Fedge best accuracy (%) | seeds | published (%) | within 2 std | "
              "best round | s/round |"), "|---|---|---|---|---|---|---|---|"]
    for partition in PARTITIONS:
        for algorithm in ALGORITHMS:
            runs = by.get((algorithm, partition, "fp32"))
            if not runs:
                continue
            best = [runs[s]["best_accuracy"] for s in sorted(runs)]
            iv = interval(best)
            shown = (f"{100 * iv.mean:.2f}" if iv.n == 1 else f"{100 * iv.mean:.2f} ± {100 * iv.half:.2f}")
            rounds = ", ".join(str(runs[s]["best_round"]) for s in sorted(runs))
            seconds = sum(r["round_seconds"] for r in runs.values()) / len(runs)
            lines.append(f"| {partition} | {algorithm} | {shown} | {', '.join(map(str, sorted(runs)))} | "
                         f"{_published(algorithm, partition)} | {_within(iv.mean, algorithm, partition)} | "
                         f"{rounds} | {seconds:.1f} |")
    compressed = [key for key in by if key[2] != "fp32"]
    if compressed:
        lines += ["", ("| partition | algorithm | codec | seeds | uplink MB | downlink MB | bytes vs fp32 "
                       "(up+down) | best accuracy (%) | difference against fp32, paired by seed |"),
                  "|---|---|---|---|---|---|---|---|---|"]
        for partition in PARTITIONS:
            for algorithm in ALGORITHMS:
                for codec in CODECS:
                    runs, base = by.get((algorithm, partition, codec)), by.get((algorithm, partition, "fp32"), {})
                    if codec == "fp32" or not runs:
                        continue
                    seeds = sorted(runs)
                    up = sum(runs[s]["uplink_bytes"] for s in seeds) / len(seeds)
                    down = sum(runs[s]["downlink_bytes"] for s in seeds) / len(seeds)
                    fp32 = sum(runs[s]["uplink_fp32_bytes"] for s in seeds) / len(seeds)
                    # fp32 both ways: the model down, the update up (SCAFFOLD: and its control variate, each way)
                    full = 2 * fp32 * (2 if algorithm == "scaffold" else 1)
                    best = [runs[s]["best_accuracy"] for s in seeds]
                    iv = interval(best)
                    pairs = [s for s in seeds if s in base]
                    diff = (verdict(paired([runs[s]["best_accuracy"] for s in pairs],
                                           [base[s]["best_accuracy"] for s in pairs])) if pairs else "no fp32 run")
                    lines.append(f"| {partition} | {algorithm} | `{CODECS[codec]['codec']}` down "
                                 f"`{CODECS[codec]['downlink_codec']}` | {', '.join(map(str, seeds))} | "
                                 f"{up / 1e6:.2f} | {down / 1e6:.2f} | {full / max(1.0, up + down):.1f}x | "
                                 f"{100 * iv.mean:.2f}" + ("" if iv.n == 1 else f" ± {100 * iv.half:.2f}") +
                                 f" | {diff} |")
    return "\n".join(lines)


def write_table(out: Path) -> str:
    cells = load_cells(out)
    command = "; ".join(sorted({c.get("command", "") for c in cells} - {""})) or "-"
    first = min((c["measured"] for c in cells), default="-")
    text = (f"NIID-Bench, Fashion-MNIST: {len(cells)} cells, measured {first}"
            f" to {max((c['measured'] for c in cells), default='-')} on {cells[0]['machine'] if cells else '-'}. "
            "Best held-out accuracy over 50 rounds; Fedge: mean ± 95% interval over the seeds shown; published: "
            "Flower's baselines/niid_bench mean ± std. Commands: " + command + "\n\n" + table(cells) + "\n")
    atomic_write_text(out / "niid-bench.md", text)
    return text


def copy_lag(run_dir: Path) -> str:
    """How far a lattice downlink's copy trails the coordinator's model in a cell's last checkpoint:
    the share of the model's move from its start the copy lacks, per tensor, and the norms."""
    import torch

    from fedge.compression.lattice import lattice_model

    state = torch.load(run_dir / "checkpoint" / "state.pt", map_location="cpu", weights_only=False)
    down = state["state"].get("downlink")
    if not down:
        raise SystemExit(f"{run_dir}: no lattice downlink in its checkpoint")
    params, base, n, steps = state["state"]["params"], down["base"], down["n"], down["steps"]
    sizes = _tensor_sizes(json.loads((run_dir / "config.json").read_text()))
    copy = lattice_model(base, torch.repeat_interleave(steps, torch.tensor(sizes)), n)
    lines = [f"{run_dir.name}, round {state['round']}, downlink {down['spec']}:",
             f"  |model - copy| / |model - start| = {float((params - copy).norm() / (params - base).norm()):.4f}",
             f"  |model| = {float(params.norm()):.2f}, |start| = {float(base.norm()):.2f}",
             "  tensor size, copy's lack, largest |n| (steps moved), the model's move in steps (RMS)"]
    for p, c, b, step in zip(torch.split(params, sizes), torch.split(copy, sizes), torch.split(base, sizes), steps):
        lines.append(f"  {p.numel():>6} {float((p - c).norm() / (p - b).norm()):.3f} "
                     f"{int(((c - b) / step).abs().max().round()):>5} {float((p - b).pow(2).mean().sqrt() / step):9.1f}")
    return "\n".join(lines)


def _tensor_sizes(config: dict[str, Any]) -> list[int]:
    """The model's tensor sizes, from the task the run's config names."""
    from fedge.tasks import make_task, tensor_sizes

    return tensor_sizes(make_task(config["settings"]["task"]).build_model().state_dict())


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # unwinds like Ctrl-C: launch() stops what it started
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="run the cells not yet in --out/cells, then rewrite the table")
    run.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS), default=["fedavg"])
    run.add_argument("--partitions", nargs="+", choices=list(PARTITIONS), default=["dir0.5"])
    run.add_argument("--codecs", nargs="+", choices=list(CODECS), default=["fp32"])
    run.add_argument("--seeds", nargs="+", type=int, default=[1])
    run.add_argument("--cell", action="append", default=[], metavar="ALGORITHM-PARTITION-CODEC-sSEED",
                     help="one cell by name, e.g. fedavg-c2-fp32-s1 (repeatable; run in the order given, "
                     "instead of the product of the lists above)")
    run.add_argument("--workers", type=int, default=default_workers(),
                     help="cells at once (default: one per core)")
    run.add_argument("--smoke", action="store_true",
                     help="4 clients, 2 rounds of 1 epoch on 2,000 training images: checks the path, not the table")
    run.add_argument("--runs", help="run directories (default: runs/niid-bench, or a smoke folder under --out)")
    sub.add_parser("table", help="rewrite the table from the cells present")
    lag = sub.add_parser("lag", help="how far a compressed cell's lattice copy trails its model (its checkpoint)")
    lag.add_argument("cell", metavar="ALGORITHM-PARTITION-CODEC-sSEED")
    lag.add_argument("--runs", default=str(Path("runs") / "niid-bench"), help="run directories")
    for p in (run, sub.choices["table"]):
        p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where cells/ and niid-bench.md live")
    args = parser.parse_args(argv)
    if args.action == "lag":
        parse_cell(args.cell, parser)
        print(copy_lag(Path(args.runs) / args.cell))
        return 0
    out: Path = args.out
    if args.action == "run":
        setup = SMOKE if args.smoke else TABLE
        runs = args.runs or str(out / "runs" if args.smoke else Path("runs") / "niid-bench")
        wanted = ([parse_cell(name, parser) for name in args.cell] if args.cell else
                  [(a, p, c, s) for s in args.seeds for a in args.algorithms for p in args.partitions
                   for c in args.codecs])
        todo = [cell for cell in wanted if not (out / "cells" / f"{cell_name(*cell)}.json").exists()]
        if todo and not fashion_mnist.available():  # said once, before any cell starts a federation
            print(f"Fashion-MNIST not found in {fashion_mnist.data_dir()}: apt-get install dataset-fashion-mnist "
                  "(or set FEDGE_FASHION_MNIST_DIR)", file=sys.stderr)
            return 2
        print(f"{len(todo)} cells to run, {args.workers} at once", flush=True)
        workers = max(1, min(args.workers, len(todo)))
        command = shlex.join([".venv/bin/python", "bench/niid_bench.py", *(argv if argv is not None else sys.argv[1:])])
        jobs = [(a, p, c, s, setup, runs, str(out), client_slots(workers), command) for a, p, c, s in todo]
        failed = [r["cell"] for r in map_runs(run_cell_or_report, jobs, workers=workers) if "error" in r]
        if failed:
            print(f"{len(failed)} cells failed: {', '.join(failed)}", flush=True)
    print(write_table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
