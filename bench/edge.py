"""Edge inference: size, accuracy and latency of fp32 eager / fp32 ONNX / int8 ONNX / pruned + int8.

For the digits CNN (38k parameters) and its width-2 and width-8 variants (151k, 2.4M), trained here on
the offline digits data, every variant is measured in one process, one thread, side by side:
size raw and zstd (level 19), held-out accuracy, single-sample p50 latency and batch-64 throughput.
The ONNX variants are exactly what ``fedge export`` ships (the same export, quantization and edge
session options). Prints a markdown table and writes bench/results/edge.{md,json} with the command.

    .venv/bin/python bench/edge.py [--epochs 6] [--runs 2000]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


import numpy as np
import torch
import zstandard

from fedge.deploy.bundle import make_session
from fedge.deploy.exporter import onnx_accuracy
from fedge.deploy.onnx_export import export_onnx
from fedge.deploy.prune import apply_pruning, fine_tune
from fedge.deploy.quantize import quantize_static_int8
from fedge.tasks import evaluate, make_task

# The demo CNN, a 4x wider one (the size of the CNN in ../shared/reference/DEPLOY.md), and a 2.4M one.
MODELS = ["digits", "digits:width=2", "digits:width=8"]
PRUNING = "channels:fraction=0.5+unstructured:sparsity=0.8"


def _median_seconds(fn, runs: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    timings = np.empty(runs)
    for i in range(runs):
        start = time.perf_counter()
        fn()
        timings[i] = time.perf_counter() - start
    return float(np.median(timings))


def _onnx_row(name: str, data: bytes, x: np.ndarray, y: np.ndarray, runs: int) -> dict:
    session = make_session(data, threads=1)
    one, batch = x[:1], x[:64]
    return {
        "variant": name, "bytes": len(data), "zstd_bytes": len(zstandard.ZstdCompressor(level=19).compress(data)),
        "accuracy": onnx_accuracy(session, x, y),
        "p50_1_s": _median_seconds(lambda: session.run(None, {"x": one}), runs),
        "batch64_s": _median_seconds(lambda: session.run(None, {"x": batch}), max(50, runs // 10)),
    }


def measure(spec: str, epochs: int, runs: int) -> list[dict]:
    task = make_task(spec)
    torch.manual_seed(0)
    model = task.build_model()
    fine_tune(model, task.train_pool(), task, epochs=epochs, lr=0.05, seed=0)
    test, pool = task.test_data(), task.train_pool()
    x, y = test.x.numpy(), test.y.numpy()
    calibration = pool.x[torch.randperm(len(pool), generator=torch.Generator().manual_seed(0))[:256]].numpy()

    import io

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    raw_state = buffer.getvalue()
    one, batch = test.x[:1], test.x[:64]
    with torch.inference_mode():
        eager = {
            "variant": "fp32 PyTorch eager", "bytes": len(raw_state),
            "zstd_bytes": len(zstandard.ZstdCompressor(level=19).compress(raw_state)),
            "accuracy": evaluate(model, test, task)["accuracy"],
            "p50_1_s": _median_seconds(lambda: model(one), runs),
            "batch64_s": _median_seconds(lambda: model(batch), max(50, runs // 10)),
        }
    fp32 = export_onnx(model, test.x[:1]).data
    rows = [eager, _onnx_row("fp32 ONNX", fp32, x, y, runs),
            _onnx_row("int8 ONNX (static QDQ)", quantize_static_int8(fp32, calibration), x, y, runs)]
    apply_pruning(model, PRUNING, pool, task, fine_tune_epochs=3)
    pruned = export_onnx(model, test.x[:1]).data
    rows.append(_onnx_row(f"pruned ({PRUNING}) + int8", quantize_static_int8(pruned, calibration), x, y, runs))
    params = sum(p.numel() for p in task.build_model().parameters())
    for row in rows:
        row |= {"model": spec, "parameters": params}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--runs", type=int, default=2000, help="timed single-sample runs per variant")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "edge"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    command = " ".join([".venv/bin/python", "bench/edge.py", *sys.argv[1:]])
    rows = [row for spec in MODELS for row in measure(spec, args.epochs, args.runs)]

    import onnxruntime

    lines = [(f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()} ({platform.processor() or 'cpu'}), "
             f"1 thread, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}. Command: `{command}`"), "",
             "| model | variant | size | zstd | held-out acc | 1-sample p50 | batch-64 samples/s |",
             "|---|---|---|---|---|---|---|"]
    verdicts = []
    for spec in MODELS:
        group = [r for r in rows if r["model"] == spec]
        for r in group:
            lines.append(f"| `{spec}` ({r['parameters']:,} params) | {r['variant']} | {r['bytes'] / 1024:,.1f} KiB | "
                         f"{r['zstd_bytes'] / 1024:,.1f} KiB | {100 * r['accuracy']:.2f}% | "
                         f"{r['p50_1_s'] * 1e6:,.1f} µs | {64 / r['batch64_s']:,.0f} |")
        eager, onnx32, int8, pruned = group
        targets = {
            "int8 vs eager, 1 sample (>= 4x)": (eager["p50_1_s"] / int8["p50_1_s"], 4.0),
            "int8 vs fp32 ONNX, batch 64 (>= 2x)": (onnx32["batch64_s"] / int8["batch64_s"], 2.0),
            "fp32 / (pruned + int8 + zstd) size (>= 10x)": (onnx32["bytes"] / pruned["zstd_bytes"], 10.0),
        }
        for name, (ratio, goal) in targets.items():
            verdicts.append({"model": spec, "target": name, "ratio": ratio, "met": ratio >= goal})
        for variant in (int8, pruned):
            drop = 100 * (onnx32["accuracy"] - variant["accuracy"])
            verdicts.append({"model": spec, "target": f"{variant['variant'].split(' (')[0]}: accuracy within 1 point "
                             "of fp32 ONNX", "ratio": -drop if abs(drop) > 1e-9 else 0.0, "met": drop <= 1.0})
    lines += ["", "| model | target | measured | met |", "|---|---|---|---|"]
    for v in verdicts:
        shown = f"{v['ratio']:.2f}x" if "accuracy" not in v["target"] else f"{v['ratio']:+.2f} points"
        lines.append(f"| `{v['model']}` | {v['target']} | {shown} | {'yes' if v['met'] else 'NO'} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d"),
                                                    "machine": platform.platform(), "rows": rows,
                                                    "targets": verdicts}, indent=2) + "\n")


if __name__ == "__main__":
    main()
