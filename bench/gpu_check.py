"""The GPU check: one command that runs, on a CUDA machine, what this project can only run there.

    make gpu-check            # or: .venv/bin/python bench/gpu_check.py --out bench/results/gpu-check.json

1. the CUDA tests (``tests/deploy/test_ddp_training.py -k cuda``; they skip elsewhere) and the
   device-placement tests, with their outcome and time;
2. the cloud trainer on one GPU (``--device cuda``, NCCL, bf16 autocast) against gloo on the same
   machine's CPUs (``--device cpu``, one process per core up to 8), the same task and epochs: on the
   GPU batches from a DataLoader (the loader-bound path) and from device-held data, at the CPU
   runs' batch and at ``--large-batch`` (its rate scaled, warm-up auto; with ``--compile`` and
   ``--channels-last`` once), with ``allreduce`` and ``qsgd:bits=4``: samples/s over each epoch's
   wall time, the share of it the GPU spent in steps, held-out accuracy, step time;
3. federated rounds on the deployment engine (``fedge local-cluster``, 5 local epochs) with every
   client on the GPU (``--client-device cuda``) and on the CPU: the mean round time after the first
   and the held-out accuracy;
4. one JSON with the card's name, the versions and every figure, and a table to paste into
   docs/cloud.md.

Without a CUDA device it says so and exits 0: nothing here is measured on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(command: list[str], timeout: float) -> tuple[int, float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    return done.returncode, time.perf_counter() - started, (done.stdout + done.stderr)[-3000:]


def _train(task: str, device: str, nproc: int, hook: str, epochs: int, batch: int, timeout: float,
           *extra: str, base_batch: int | None = None) -> dict:
    """One cloud-train run; its last metrics row and summary (or the failure's tail)."""
    with tempfile.TemporaryDirectory() as out:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        command = [torchrun, f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", "--master-port=29571",
                   "-m", "fedge.deploy.train", "--task", task, "--epochs", str(epochs), "--batch-size", str(batch),
                   "--base-batch", str(base_batch or batch * nproc), "--hook", hook, "--device", device, "--out", out,
                   *extra]
        code, seconds, tail = _run(command, timeout)
        result: dict = {"device": device, "processes": nproc, "hook": hook, "batch": batch, "options": " ".join(extra),
                        "exit": code, "wall_s": round(seconds, 1)}
        rows = Path(out) / "metrics.jsonl"
        if code != 0 or not rows.exists():
            return {**result, "error": tail}
        last = json.loads(rows.read_text().splitlines()[-1])
        keep = ("samples_per_s", "step_s", "forward_s", "data_wait_s", "gpu_busy", "data", "amp", "accuracy",
                "test_loss", "train_loss", "backend")
        return {**result, **{k: last.get(k) for k in keep}}


def _federated(task: str, device: str, supernodes: int, rounds: int, local_epochs: int, timeout: float) -> dict:
    """One ``fedge local-cluster`` run with every client on ``device``: the mean round time after
    the first (start-up excluded) and the final held-out accuracy."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "fedge.server.cli", "local-cluster", "--supernodes", str(supernodes),
                   "--clients-per-round", str(supernodes), "--rounds", str(rounds), "--task", task,
                   "--local-epochs", str(local_epochs), "--client-device", device, "--export-bundle", "",
                   "--run-dir", str(Path(out) / "run")]
        code, seconds, tail = _run(command, timeout)
        result: dict = {"client_device": device, "supernodes": supernodes, "rounds": rounds,
                        "local_epochs": local_epochs, "exit": code, "wall_s": round(seconds, 1)}
        rows_path = Path(out) / "run" / "metrics.jsonl"
        if code != 0 or not rows_path.exists():
            return {**result, "error": tail}
        rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
        later = [r["seconds"] for r in rows[1:] if isinstance(r.get("seconds"), (int, float))]
        return {**result, "round_s": sum(later) / len(later) if later else None, "accuracy": rows[-1].get("accuracy")}


PARTS = ("tests", "trainer", "federated")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="fashion", help="the task (fashion when its data is installed, else digits)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--large-batch", type=int, default=1024,
                        help="the large-batch runs' batch (their rate scaled from --batch-size's)")
    parser.add_argument("--supernodes", type=int, default=4, help="SuperNodes of the federated runs")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the federated runs")
    parser.add_argument("--local-epochs", type=int, default=5, help="local epochs of the federated runs")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which parts to run, comma-separated, of {', '.join(PARTS)} (a GPU session's time is "
                        "short: split the check over two calls if one would not fit)")
    parser.add_argument("--rehearse", action="store_true",
                        help="run every part on the CPU with the GPU runs' options, to prove the script before a "
                        "GPU session spends its minutes on it (figures of a rehearsal are not GPU figures)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu-check.json")
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if parts - set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}; known: {', '.join(PARTS)}")
    import torch

    if not torch.cuda.is_available() and not args.rehearse:
        print("gpu-check: no CUDA device on this machine; nothing to measure (run it where a GPU is, or --rehearse)")
        return 0
    gpu = "cpu" if args.rehearse else "cuda"  # a rehearsal runs the GPU runs on the CPU
    from fedge.tasks import make_task

    task = args.task
    try:
        make_task(task).train_pool()
    except Exception as err:  # the Fashion-MNIST data package is not everywhere
        print(f"gpu-check: task {task!r} unavailable ({err}); using digits")
        task = "digits"
    report: dict = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"), "rehearsal": args.rehearse,
        "card": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU rehearsal)",
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "cpus": os.cpu_count(), "task": task, "epochs": args.epochs, "batch_size": args.batch_size,
        "command": " ".join([".venv/bin/python", "bench/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    ok = True
    if "tests" in parts:
        code, seconds, tail = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    "tests/deploy/test_ddp_training.py", "tests/tasks/test_device.py", "-k",
                                    "cuda or device"], timeout=1800)
        report["cuda_tests"] = {"exit": code, "seconds": round(seconds, 1), "tail": tail[-800:]}
        ok = ok and code == 0
    b, e, big = args.batch_size, args.epochs, args.large_batch
    if "trainer" in parts:
        report["runs"] = [  # the loader-bound path the issue measured, the device-held batches, a large batch
            _train(task, gpu, 1, "allreduce", e, b, 3600, "--data", "loader"),
            _train(task, gpu, 1, "allreduce", e, b, 3600, "--data", "device"),
            _train(task, gpu, 1, "qsgd:bits=4", e, b, 3600, "--data", "device"),
            _train(task, gpu, 1, "allreduce", e, big, 3600, "--data", "device", base_batch=b),
            _train(task, gpu, 1, "allreduce", e, big, 3600, "--data", "device", "--channels-last", "--compile",
                   base_batch=b),
            _train(task, gpu, 1, "qsgd:bits=4", e, big, 3600, "--data", "device", base_batch=b),
            _train(task, "cpu", min(8, os.cpu_count() or 1), "allreduce", e, b, 7200),
        ]
        ok = ok and all(r["exit"] == 0 for r in report["runs"])
    if "federated" in parts:
        report["federated"] = [_federated(task, device, args.supernodes, args.rounds, args.local_epochs, 3600)
                               for device in (gpu, "cpu")]
        ok = ok and all(r["exit"] == 0 for r in report["federated"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['card']} x{report['gpus']}, torch {report['torch']} (CUDA {report['cuda']}), {report['date']}")
    if "cuda_tests" in report:
        print(f"CUDA tests: exit {report['cuda_tests']['exit']} in {report['cuda_tests']['seconds']:.0f} s")
    if "runs" in report:
        print("| device | processes | hook | batch | options | samples/s | GPU busy | accuracy | step (ms) | exit |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
        for r in report["runs"]:
            step = f"{1000 * r['step_s']:.2f}" if r.get("step_s") else "-"
            busy = f"{r['gpu_busy']:.0%}" if r.get("gpu_busy") is not None else "-"
            print(f"| {r['device']} | {r['processes']} | {r['hook']} | {r['batch']} | {r['options'] or '-'} | "
                  f"{r.get('samples_per_s') or 0:,.0f} | {busy} | {r.get('accuracy') or 0:.4f} | {step} | {r['exit']} |")
    if "federated" in report:
        print("| clients on | SuperNodes | local epochs | round (s, after the first) | accuracy | exit |\n"
              "|---|---|---|---|---|---|")
        for r in report["federated"]:
            round_s = f"{r['round_s']:.2f}" if r.get("round_s") else "-"
            print(f"| {r['client_device']} | {r['supernodes']} | {r['local_epochs']} | {round_s} | "
                  f"{r.get('accuracy') or 0:.4f} | {r['exit']} |")
    failed = [r for r in report.get("runs", []) + report.get("federated", []) if r["exit"] != 0]
    for r in failed:
        print(f"FAILED {r}")
    print(f"written: {args.out}\nreproduce: {report['command']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
