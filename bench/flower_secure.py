"""Secure aggregation from a user's Flower app, side by side with the same app's plain FedAvg.

The example app's ServerApp and ClientApp (``examples/flower-app``, as ``bench/flower_stragglers.py``
stages them) on Flower's simulation engine, same data split and seed, one run after the other in
one invocation: FedAvg through ``compressed(FedAvg(...), uplink="none")`` (fp32 updates, counted by
the wrapper) against ``secure(FedAvg(...), secure_aggregation=SPEC)`` with ``secure_mod``. Reported:
the server's held-out accuracy after the last round and its best, and the uplink bytes every round's
train metrics report (``fedge-uplink-bytes``: fp32 payloads; or the masked uploads plus the key
exchange's replies), summed over the rounds.

    .venv/bin/python bench/flower_secure.py --repeats 2
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.flower_app import app_arguments, report  # noqa: E402
from bench.flower_stragglers import bench_app, run_app  # noqa: E402
from bench.sigterm import stop_on_sigterm  # noqa: E402


def main() -> int:
    stop_on_sigterm()  # a killed benchmark stops every process it started
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    app_arguments(parser)
    parser.add_argument("--secure", default="secagg:bits=12,clip=0.5,weight-cap=512")
    parser.add_argument("--repeats", type=int, default=1, help="run both this many times, alternating")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "flower-secure"))
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/flower_secure.py", *sys.argv[1:]])
    runs = []
    with tempfile.TemporaryDirectory(prefix="fedge-bench-flower-secure-") as tmp_name:
        for repeat in range(args.repeats):
            for label, strategy, codec in (("FedAvg, fp32", "fedavg", "none"),
                                           ("secure(FedAvg)", "secure", args.secure)):
                tmp = Path(tmp_name) / f"{repeat}-{strategy}"
                tmp.mkdir()
                print(f"== {label} (repeat {repeat + 1})", flush=True)
                run_args = argparse.Namespace(**{**vars(args), "codec": codec, "stragglers": "none", "target": 1.0})
                result = run_app(bench_app(tmp), run_args, strategy, tmp)
                uplink = sum(float(m.get("fedge-uplink-bytes", 0)) for m in result["train_metrics"].values())
                survivors = [m.get("fedge-secagg-survivors") for m in result["train_metrics"].values()]
                runs.append({"label": label, "repeat": repeat + 1, "final_accuracy": result["final_accuracy"],
                             "best_accuracy": result["best_accuracy"], "uplink_bytes": uplink,
                             "rounds": result["versions"], "survivors": survivors,
                             "wall_seconds": result["wall_seconds"]})
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()}: {args.clients} clients, "
             f"Dirichlet({args.alpha}), {args.rounds} rounds of {args.local_epochs} local epochs, Flower's "
             f"simulation engine, the example app's own code; secure aggregation `{args.secure}`; `{command}`", "",
             "| run | repeat | final acc | best acc | uplink MB | uplink vs fp32 | wall s |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        fp32 = next(x["uplink_bytes"] for x in runs if x["repeat"] == r["repeat"] and x["label"].startswith("FedAvg"))
        lines.append(f"| {r['label']} | {r['repeat']} | {100 * r['final_accuracy']:.2f}% | "
                     f"{100 * r['best_accuracy']:.2f}% | {r['uplink_bytes'] / 1e6:.2f} | "
                     f"{fp32 / r['uplink_bytes']:.2f}x fewer | {r['wall_seconds']:.0f} |")
    report(args.out, "\n".join(lines), {"command": command, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
