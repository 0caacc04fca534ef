"""Allreduce bus bandwidth and DDP step time per gradient hook, 1 vs 2 processes (gloo on CPU).

Bus bandwidth follows the nccl-tests convention: ``algbw = bytes / time`` and
``busbw = algbw * 2 (n - 1) / n`` (what a ring allreduce moves over each link). Step time uses the
synthetic task with a ~10M-parameter MLP, measured by deploy.train's own metrics (one epoch per
configuration). Prints markdown tables and writes bench/results/allreduce.json with the command.

    .venv/bin/python bench/allreduce.py [--max-mb 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


TASK = "synthetic:dim=1024,hidden=2048,layers=3,samples=4096,test_samples=512"  # ~10.5M parameters
HOOKS = ["allreduce", "fp16", "powersgd:rank=4,start=2", "qsgd:bits=4", "topk:ratio=0.01,sample=0.01",
         "local-sgd:period=4"]


def _hook_args(hook: str) -> list[str]:
    """deploy.train flags for one row: local SGD is its own option, not a gradient hook."""
    if hook.startswith("local-sgd:period="):
        return ["--local-sgd", hook.split("=", 1)[1], "--local-sgd-warmup", "0"]
    return ["--hook", hook]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(max_mb: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world, rows = dist.get_world_size(), []
    size_mb = 1
    while size_mb <= max_mb:
        tensor = torch.randn(size_mb * 2**20 // 4)
        dist.all_reduce(tensor)  # warm-up
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            best = min(best, time.perf_counter() - start)
        algbw = size_mb * 2**20 / best
        rows.append({"mb": size_mb, "seconds": best, "algbw_gbps": algbw / 1e9,
                     "busbw_gbps": algbw * 2 * (world - 1) / world / 1e9})
        size_mb *= 4
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _torchrun(nproc: int, args: list[str]) -> None:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = [torchrun, f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={_port()}", *args]
    subprocess.run(command, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-mb", type=int, default=256)
    parser.add_argument("--hooks", default=",".join(HOOKS), help=f"comma-separated subset of {','.join(HOOKS)}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "allreduce.json"))
    args = parser.parse_args()
    if args.worker:
        _worker(args.max_mb, args.worker)
        return
    command = " ".join([Path(sys.executable).name, *sys.argv])
    with tempfile.TemporaryDirectory() as tmp:
        _torchrun(2, [__file__, "--max-mb", str(args.max_mb), "--worker", f"{tmp}/bw.json"])
        bandwidth = json.loads(Path(f"{tmp}/bw.json").read_text())
        steps = []
        for hook in args.hooks.split(","):
            if hook not in HOOKS:
                parser.error(f"--hooks: {hook!r} is not one of {', '.join(HOOKS)}")
            for nproc in (1, 2):
                out = f"{tmp}/{nproc}-{len(steps)}"
                _torchrun(nproc, ["-m", "fedge.deploy.train", "--task", TASK, "--epochs", "1", "--max-steps", "12",
                                  "--batch-size", "64", *_hook_args(hook), "--bucket-cap-mb", "64", "--out", out])
                row = json.loads(Path(out, "metrics.jsonl").read_text().splitlines()[-1])
                steps.append({"hook": hook, "processes": nproc, "step_s": row["step_s"],
                              "samples_per_s": row["samples_per_s"],
                              "payload_bytes_per_step": row["payload_bytes_per_step"],
                              "dense_gradient_bytes": row["dense_gradient_bytes_per_step"]})
                print(f"{hook} x{nproc}: {row['step_s']:.3f} s/step", file=sys.stderr)
    print(f"\nMeasured {time.strftime('%Y-%m-%d')} on {platform.machine()}, gloo on 127.0.0.1, 2 processes. "
          f"Command: `{command}`\n")
    print("| buffer MB | seconds | algbw GB/s | busbw GB/s |\n|---|---|---|---|")
    for r in bandwidth:
        print(f"| {r['mb']} | {r['seconds']:.4f} | {r['algbw_gbps']:.2f} | {r['busbw_gbps']:.2f} |")
    print(f"\nDDP step time, task `{TASK}`, batch 64 per process (scaling efficiency = "
          "throughput(2) / (2 x throughput(1))):\n")
    print("| hook | s/step, 1 proc | s/step, 2 procs | samples/s 1 | samples/s 2 | scaling efficiency | payload B/step |")
    print("|---|---|---|---|---|---|---|")
    for hook in args.hooks.split(","):
        one = next(s for s in steps if s["hook"] == hook and s["processes"] == 1)
        two = next(s for s in steps if s["hook"] == hook and s["processes"] == 2)
        efficiency = two["samples_per_s"] / (2 * one["samples_per_s"])
        payload = two["payload_bytes_per_step"]
        print(f"| `{hook}` | {one['step_s']:.3f} | {two['step_s']:.3f} | {one['samples_per_s']:.0f} | "
              f"{two['samples_per_s']:.0f} | {efficiency:.0%} | {payload if payload is None else f'{payload:,.0f}'} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
                               "bandwidth": bandwidth, "steps": steps}, indent=2) + "\n")


if __name__ == "__main__":
    main()
