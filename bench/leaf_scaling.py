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
"""

from __future__ import annotations

import argparse
import json
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


def tiered(tmp: Path, devices: int, leaves: int, rounds: int) -> dict:
    per_leaf = [list(range(devices))[i::leaves] for i in range(leaves)]
    coordinators = {}
    for index, partitions in enumerate(per_leaf):
        engine = build_engine({**COMMON, "rounds": rounds, "clients_per_round": len(partitions),
                               "run_dir": str(tmp / f"leaf-{index}")})
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

    root = build_engine({**COMMON, "rounds": rounds, "clients_per_round": leaves, "run_dir": str(tmp / "root")})
    began = time.thread_time()
    root.run(InProcessGrid(leaves, app=app, node_config={i: {"partition-id": i, "num-partitions": leaves}
                                                          for i in range(leaves)}),
             initial_params(make_task("digits"), 0))
    rows = _rows(root)
    return {"devices": devices, "leaves": leaves, "root_messages_per_round": 2 * rows[-1]["clients_used"],
            "root_ingress_bytes_per_round": rows[-1]["uplink_bytes"],
            "root_cpu_s_per_round": (time.thread_time() - began - inside[0]) / len(rows),
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
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "leaf-scaling.json")
    args = parser.parse_args(argv)
    results = []
    for devices in (int(n) for n in args.devices.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            tree = tiered(Path(tmp), devices, args.leaves, args.rounds)
            one = flat(Path(tmp), devices, args.rounds)
        results.append({"tree": tree, "flat": one})
        print(json.dumps(results[-1]), flush=True)
    command = " ".join([".venv/bin/python", "bench/leaf_scaling.py", *(argv if argv is not None else sys.argv[1:])])
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("| devices | root messages/round | root ingress bytes/round | root CPU s/round | flat messages/round | "
          "flat ingress bytes/round |\n|---|---|---|---|---|---|")
    for r in results:
        t, f = r["tree"], r["flat"]
        print(f"| {t['devices']:,} | {t['root_messages_per_round']} | {t['root_ingress_bytes_per_round']:,} | "
              f"{t['root_cpu_s_per_round']:.3f} | {f['messages_per_round']:,} | {f['ingress_bytes_per_round']:,} |")
    print(f"written: {args.out}\nreproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
