"""What the root of a two-tier federation handles as the devices grow: messages, ingress bytes and
CPU per round, against one flat coordinator over the same devices.

The root talks to L leaves (bridges), not to the N devices: per round it sends L models and takes L
replies, whatever N is. Measured in one process on the engine's in-process grid (leaves and
devices simulated, no network): the root's engine over its L bridges, each bridge running its
leaf's step (``fedge.server.leaf``) inside the root's call, and the flat engine over all N devices.
The root's CPU excludes its leaves' steps (each bridge's call is timed on this thread's CPU clock
and subtracted); the flat engine's CPU includes its devices' training, which runs in the same
thread (so only the root's figure is the coordinator's own; the flat one is an upper bound).

    .venv/bin/python bench/leaf_scaling.py --devices 16,100,1000 --leaves 2 --rounds 2
    FEDGE_FASHION_MNIST_DIR=... .venv/bin/python bench/leaf_scaling.py --task fashion --devices 10000 \
        --per-round 100 --rounds 30 --no-flat --out bench/results/leaf-scaling-10k.json

With ``--per-round K`` each leaf samples its share of K devices per step (stateful devices: each
keeps its error-feedback memory between the steps it is sampled in); the report adds the wall time
per round and the process's peak resident memory (the root, the leaves and every simulated device
together).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedge.edge_client.bridge import bridge_app  # noqa: E402
from fedge.server.leaf import LeafCoordinator  # noqa: E402
from fedge.server.run.initial_model import initial_params  # noqa: E402
from fedge.tasks import make_task  # noqa: E402
from tests.server.engines import build_engine  # noqa: E402
from tests.server.in_process_grid import InProcessGrid  # noqa: E402

COMMON = dict(local_epochs=1, codec="qsgd:bits=4,bucket=512,norm=max", weight_cap="none", round_timeout=600.0,
              wait_for_nodes=1.0, partitioning="iid", evaluate_every=1000)


def _rows(engine) -> list[dict]:  # type: ignore[no-untyped-def]
    return engine.run_dir.metrics.read()


def tiered(tmp: Path, devices: int, leaves: int, rounds: int, task: str = "digits", per_round: int = 0) -> dict:
    per_leaf = [list(range(devices))[i::leaves] for i in range(leaves)]
    coordinators = {}
    for index, partitions in enumerate(per_leaf):
        sampled = max(1, per_round // leaves) if per_round else len(partitions)
        engine = build_engine({**COMMON, "task": task, "rounds": rounds, "clients_per_round": sampled,
                               "min_replies": sampled, "run_dir": str(tmp / f"leaf-{index}")})
        grid = InProcessGrid(len(partitions), first_node_id=10_000 * (index + 1),
                             node_config={i: {"partition-id": p, "num-partitions": devices}
                                          for i, p in enumerate(partitions)})
        coordinators[index] = LeafCoordinator(engine, grid)
    apps = {index: bridge_app(leaf) for index, leaf in coordinators.items()}
    inside = [0.0]

    def app(msg, context):  # type: ignore[no-untyped-def]
        began = time.thread_time()
        try:
            return apps[int(context.node_config["partition-id"])](msg, context)
        finally:
            inside[0] += time.thread_time() - began

    root = build_engine({**COMMON, "task": task, "rounds": rounds, "clients_per_round": leaves,
                         "run_dir": str(tmp / "root")})
    began, wall = time.thread_time(), time.perf_counter()
    root.run(InProcessGrid(leaves, app=app, node_config={i: {"partition-id": i, "num-partitions": leaves}
                                                          for i in range(leaves)}),
             initial_params(make_task(task), 0))
    rows = _rows(root)
    return {"devices": devices, "leaves": leaves, "task": task, "per_round": per_round or devices,
            "rounds": len(rows), "root_messages_per_round": 2 * rows[-1]["clients_used"],
            "root_ingress_bytes_per_round": rows[-1]["uplink_bytes"],
            "root_cpu_s_per_round": (time.thread_time() - began - inside[0]) / len(rows),
            "wall_s_per_round": (time.perf_counter() - wall) / len(rows),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "accuracy": rows[-1].get("accuracy")}


def flat(tmp: Path, devices: int, rounds: int) -> dict:
    engine = build_engine({**COMMON, "rounds": rounds, "clients_per_round": devices, "run_dir": str(tmp / "flat")})
    began = time.thread_time()
    engine.run(InProcessGrid(devices, node_config={i: {"partition-id": i, "num-partitions": devices}
                                                  for i in range(devices)}), initial_params(make_task("digits"), 0))
    rows = _rows(engine)
    return {"devices": devices, "messages_per_round": 2 * rows[-1]["clients_used"],
            "ingress_bytes_per_round": rows[-1]["uplink_bytes"],
            "cpu_s_per_round_with_devices": (time.thread_time() - began) / len(rows),
            "accuracy": rows[-1].get("accuracy")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="16,100,1000", help="device counts, comma-separated")
    parser.add_argument("--leaves", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--per-round", type=int, default=0, help="devices sampled per round, all leaves together "
                        "(0: every device)")
    parser.add_argument("--no-flat", action="store_true", help="skip the flat coordinator (10,000 devices)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "leaf-scaling.json")
    args = parser.parse_args(argv)
    results = []
    for devices in (int(n) for n in args.devices.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            tree = tiered(Path(tmp), devices, args.leaves, args.rounds, args.task, args.per_round)
            one = None if args.no_flat else flat(Path(tmp), devices, args.rounds)
        results.append({"tree": tree, "flat": one})
        print(json.dumps(results[-1]), flush=True)
    command = " ".join([".venv/bin/python", "bench/leaf_scaling.py", *(argv if argv is not None else sys.argv[1:])])
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("| devices | per round | root messages/round | root ingress bytes/round | root CPU s/round | wall s/round | "
          "peak RSS MiB | accuracy | flat messages/round | flat ingress bytes/round |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t, f = r["tree"], r["flat"] or {}
        print(f"| {t['devices']:,} | {t['per_round']:,} | {t['root_messages_per_round']} | "
              f"{t['root_ingress_bytes_per_round']:,} | {t['root_cpu_s_per_round']:.3f} | {t['wall_s_per_round']:.2f} | "
              f"{t['peak_rss_mib']:,.0f} | {t['accuracy'] or 0:.4f} | {f.get('messages_per_round', '-')} | "
              f"{f.get('ingress_bytes_per_round', '-')} |")
    print(f"written: {args.out}\nreproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
