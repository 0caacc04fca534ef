"""The main job's start, measured phase by phase: ``fedge demo`` (``make demo``'s command) against
Flower's own FedAvg app (``examples/flower-app`` as Flower wrote it, docs/flower.md's lines taken
out, run with the demo's training: 5 local epochs, batch 32, lr 0.1, Dirichlet(0.5)), interleaved,
on this machine, as whole processes. The app holds out the demo's images (``fedge.tasks.digits``:
stratified 20%, seed 42, in place of the example's seeded permutation), so both accuracies are
measured on the same 360 images: with its own split the app scored 0.6-1.1 points above the demo on
two pairs and 0.0-0.3 with the demo's (2026-12-04, 2-core EPYC): the gap was the images.

Phases of ``fedge demo`` (and with ``--local-cluster`` of ``fedge local-cluster``, the deployment
engine: a SuperLink and a SuperNode per client), from its run directory (file times, and each metrics row's
``wall_seconds`` from the engine's start): the SuperLink started (the CLI's imports and checks: its
log file appears), the ServerApp started (``config.json``), the engine begun (``algorithm.json``: task,
model and algorithm built), the first round done, the last round done, the summary written, and
the command's exit. Phases of Flower's app, from its SuperLink's start and its ``flwr run``
output stamped as each line arrives: the SuperLink up, the run submitted, the first
``[ROUND 1/...]`` line, the last round's line, and the exit. Both end with every process stopped.

    .venv/bin/python bench/start_profile.py --repeats 2                  # 10 clients, 30 rounds, digits
    .venv/bin/python bench/start_profile.py --repeats 1 --local-cluster  # and the deployment engine
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import subprocess
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

FEDGE = str(Path(sys.executable).parent / "fedge")

#: the example's held-out split, and the demo's in its place (``fedge.tasks.digits._compute_split``)
EXAMPLE_SPLIT = """    order = np.random.default_rng(42).permutation(len(y))
    cut = len(y) // 5
    return x[order[cut:]], y[order[cut:]], x[order[:cut]], y[order[:cut]]
"""
DEMO_SPLIT = """    from sklearn.model_selection import train_test_split
    train, test = train_test_split(list(range(len(y))), test_size=0.2, stratify=y, random_state=42)
    return x[train], y[train], x[test], y[test]
"""
#: the most the demo's mean held-out accuracy may fall below the app's (issue 49), in points
ACCURACY_POINTS = 0.5
#: when the demo's first round should have gone out, seconds after its command (issue 49)
FIRST_ROUND_S = 8.0


def with_demo_split(app: Path) -> Path:
    """``app`` holding out the images ``fedge demo`` holds out (its task module's split rewritten)."""
    task = app / "digitsapp" / "task.py"
    text = task.read_text()
    if text.count(EXAMPLE_SPLIT) != 1:
        raise SystemExit(f"{task}: the example's split changed; update EXAMPLE_SPLIT in {Path(__file__).name}")
    task.write_text(text.replace(EXAMPLE_SPLIT, DEMO_SPLIT))
    return app


def fedge_demo(tmp: Path, name: str, clients: int, rounds: int, command: str = "demo") -> dict:
    """``fedge demo`` (simulation engine) or ``fedge local-cluster`` (deployment engine: a SuperLink
    and a SuperNode per client on 127.0.0.1), with the same training."""
    run_dir = tmp / name
    began = time.time()
    nodes = ["--clients", str(clients)] if command == "demo" else ["--supernodes", str(clients)]
    superlink = run_dir / "logs" / "superlink.log"  # created as the CLI starts Flower's first process
    with subprocess.Popen([FEDGE, command, *nodes, "--rounds", str(rounds), "--export-bundle", "",
                           "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as done:
        while done.poll() is None and not superlink.exists():
            time.sleep(0.05)
        started = time.time()
        stdout, stderr = done.communicate()
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"fedge {command} failed:\n{stdout[-2000:]}{stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    engine = (run_dir / "algorithm.json").stat().st_mtime
    return {"system": f"fedge {command}", "wall_s": ended - began, "phases": {
        "SuperLink started": started - began,
        "ServerApp started": (run_dir / "config.json").stat().st_mtime - began,
        "engine begun": engine - began,
        "first round done": engine + rows[0]["wall_seconds"] - began,
        "last round done": engine + rows[-1]["wall_seconds"] - began,
        "summary written": (run_dir / "summary.json").stat().st_mtime - began,
        "exit": ended - began}, "final_accuracy": rows[-1]["accuracy"]}


def flower_app(tmp: Path, app: Path, name: str, clients: int, rounds: int) -> dict:
    home = tmp / f"home-{name}"
    results = tmp / f"{name}.json"
    # the same training as fedge demo's defaults: 5 local epochs of batch 32 at lr 0.1, Dirichlet(0.5)
    config = {"num-server-rounds": rounds, "local-epochs": 5, "lr": 0.1, "batch-size": 32, "dirichlet-alpha": 0.5,
              "uplink": "", "results": str(results)}
    began = time.time()
    stamps: dict[str, float] = {}
    with ProcessGroup(tmp / f"logs-{name}", env=flower_environment(home),
                      also_match={"FLWR_HOME": str(home)}) as group:
        flower = FlowerLaunch(group, home, isolation="subprocess")
        flower.start_superlink(simulation=True, cwd=tmp)
        stamps["SuperLink up"] = time.time() - began
        runner = flower.submit(app, config, federation_config={
            "num-supernodes": clients, "client-resources-num-cpus": 1, "init-args-num-cpus": 2}, cwd=tmp)
        stamps["run submitted"] = time.time() - began
        seen = 0

        def tick() -> bool:  # stamp each new line of the run's output as it lands
            nonlocal seen
            text = runner.log_path.read_text(errors="replace") if runner.log_path.exists() else ""
            for line in text[seen:].splitlines():
                if re.search(r"\[ROUND 1/", line) and "first round started" not in stamps:
                    stamps["first round started"] = time.time() - began
                if re.search(rf"\[ROUND {rounds}/", line):
                    stamps["last round started"] = time.time() - began
            seen = len(text)
            return False

        flower.follow(runner, time.monotonic() + 3600, tick, interval=0.05)
        if runner.popen.returncode != 0:
            raise SystemExit(f"{name}: flwr run failed:\n{runner.log_tail(40)}")
        stamps["run finished"] = time.time() - began
    stamps["exit"] = time.time() - began
    data = json.loads(results.read_text())
    return {"system": "Flower's FedAvg app", "wall_s": stamps["exit"], "phases": stamps,
            "final_accuracy": data["evaluate"][str(rounds)]["accuracy"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved pairs (Flower, then fedge demo)")
    parser.add_argument("--local-cluster", action="store_true",
                        help="also `fedge local-cluster` (the deployment engine) after each pair")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "start-profile.json"))
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/start_profile.py", *sys.argv[1:]])
    runs = []
    with tempfile.TemporaryDirectory(prefix="fedge-bench-start-") as tmp_name:
        tmp = Path(tmp_name)
        app = with_demo_split(plain_flower_app(APP, tmp / "plain-app"))
        for repeat in range(args.repeats):
            runs.append(flower_app(tmp, app, f"flower-{repeat}", args.clients, args.rounds))
            runs.append(fedge_demo(tmp, f"demo-{repeat}", args.clients, args.rounds))
            if args.local_cluster:
                runs.append(fedge_demo(tmp, f"cluster-{repeat}", args.clients, args.rounds, "local-cluster"))
    print(f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()}, {args.clients} clients, {args.rounds} "
          f"rounds, digits, {args.repeats} interleaved pair(s): `{command}`\n")
    for r in runs:
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items())
        print(f"- {r['system']}: {r['wall_s']:.1f} s, accuracy {100 * r['final_accuracy']:.1f}% ({phases})")
    flower = [r["wall_s"] for r in runs if r["system"] == "Flower's FedAvg app"]
    fedge = [r["wall_s"] for r in runs if r["system"] == "fedge demo"]
    ratio = sum(fedge) / sum(flower)
    print(f"\nfedge demo / Flower's app, whole processes: {ratio:.2f}x ({', '.join(f'{f / w:.2f}x' for f, w in zip(fedge, flower))} per pair)")
    app_accuracy, demo_accuracy = (
        100 * sum(r["final_accuracy"] for r in runs if r["system"] == system) / len(fedge)
        for system in ("Flower's FedAvg app", "fedge demo"))
    gap = app_accuracy - demo_accuracy
    print(f"held-out accuracy, mean over the pairs (the same 360 images): Flower's app {app_accuracy:.2f}%, "
          f"fedge demo {demo_accuracy:.2f}%: {gap:+.2f} points "
          f"({'within' if gap <= ACCURACY_POINTS else 'more than'} the {ACCURACY_POINTS} points allowed)")
    begun = [r["phases"]["engine begun"] for r in runs if r["system"] == "fedge demo"]
    print(f"fedge demo's first round sent (engine begun) {min(begun):.1f}-{max(begun):.1f} s after its command "
          f"({'within' if max(begun) <= FIRST_ROUND_S else 'later than'} {FIRST_ROUND_S:g} s)")
    cluster = [r["wall_s"] for r in runs if r["system"] == "fedge local-cluster"]
    if cluster:
        print(f"fedge local-cluster / Flower's app: {sum(cluster) / sum(flower):.2f}x "
              f"({', '.join(f'{c / w:.2f}x' for c, w in zip(cluster, flower))} per pair)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "runs": runs, "ratio": ratio, "accuracy_gap_points": gap,
                               "first_round_sent_s": max(begun)}, indent=2) + "\n")
    print(f"written: {out}\nreproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
