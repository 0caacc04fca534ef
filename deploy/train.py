"""Cloud tier: data-parallel training with DistributedDataParallel, launched by ``torchrun``.

    torchrun --nproc-per-node 2 -m fedge.deploy.train --task digits --epochs 5 --hook allreduce --out runs/cloud

torchrun does process management and rendezvous (multi-node: ``--nnodes/--node-rank/--rdzv-endpoint``).
The backend follows the device: NCCL on CUDA, gloo on CPU. A DistributedSampler shards the data;
the rate is ``--lr``, warmed up linearly over ``--warmup-steps``; with ``--base-batch`` (the global
batch ``--lr`` was tuned for) it follows the linear scaling rule (Goyal et al. 2017,
https://arxiv.org/abs/1706.02677), ``lr = base_lr * global_batch / base_batch``.

On a GPU the batches are sliced from the training data held on the device (``--data``,
``fedge.deploy.batches``), the forward pass runs in bf16 (``--amp``), and ``--compile`` and
``--channels-last`` are there for convolutional models; each epoch's row reports samples/s over the
epoch's wall time (data included) and, on CUDA, the share of it covered by the steps' spans on the GPU's
clock (``gpu_span``). That span includes the gaps in which the GPU waits for the host's next launch, so
it is not the GPU's busy share: a step time that stays flat as the batch grows says the host sets the pace.

Gradient communication (``--hook``): ``allreduce`` (DDP default), ``fp16`` (bf16 on NCCL),
``powersgd:rank=R,start=S`` (Vogels et al. 2019; on gloo only with a single bucket, because several
buckets break there, pytorch#58467), or any Fedge codec spec over allgather with error feedback
(e.g. ``qsgd:bits=4``, ``topk:ratio=0.01``).

Rank 0 alone writes: a checkpoint after every epoch (atomic; ``--resume`` continues from it),
metrics as JSON lines (loss, held-out accuracy, samples/s, step time split into compute and
communication where measurable, bytes per step), and the final fp32 model as ``model.pt`` in the
format the coordinator accepts as its initial model.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from fedge.deploy.atomic import atomic_torch_save, atomic_write_text
from fedge.deploy.batches import DATA_CHOICES, make_batches
from fedge.deploy.compile_check import compiled_gradient_error
from fedge.deploy.model_file import ModelFile, save_model_file
from fedge.tasks.device import gpu_count, to_device

__all__ = ["AMP_CHOICES", "DEVICE_CHOICES", "DeviceError", "choose_device", "main", "parse_args", "peak_rate"]

#: ``--device``: where each process trains
DEVICE_CHOICES = ("auto", "cpu", "cuda")
#: ``--amp``: the forward pass's precision
AMP_CHOICES = ("auto", "bf16", "off")
#: torch.compile modes offered (reduce-overhead: CUDA graphs; its effect needs a GPU to show)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def peak_rate(lr: float, global_batch: int, base_batch: int) -> float:
    """The rate after warm-up: ``lr`` itself, or scaled linearly from ``base_batch`` to
    ``global_batch`` when the user says which batch ``lr`` was tuned for. Scaling was the default
    (from a base of 32) and turned ``--batch-size 256`` into a rate of 0.4 that sent the model to
    chance, on a GPU and on 8 CPU processes alike; a longer warm-up did not save it (digits, 40
    epochs: 1 seed of 3 learned). So it is opt-in, as in mmengine's ``auto_scale_lr``."""
    return lr * global_batch / base_batch if base_batch > 0 else lr

log = logging.getLogger("fedge.deploy.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fedge.deploy.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = no limit)")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="the learning rate (of the global batch, or of --base-batch samples when given)")
    parser.add_argument("--base-batch", type=int, default=0,
                        help="the global batch --lr was tuned for: scale the rate linearly to the actual global "
                        "batch (Goyal et al. 2017); 0 (default): no scaling")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hook", default="allreduce")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--local-sgd", type=int, default=0, metavar="PERIOD",
                        help="local SGD: average the models every PERIOD steps instead of allreducing "
                        "gradients every step (PeriodicModelAverager; 0 = off)")
    parser.add_argument("--local-sgd-warmup", type=int, default=20, metavar="STEPS",
                        help="steps of plain gradient allreduce before local SGD starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="auto: one GPU per process where CUDA is (NCCL), else the CPU (gloo); cpu: gloo "
                        "on the CPU even on a GPU machine; cuda: refuse to run without a GPU per process")
    parser.add_argument("--data", choices=DATA_CHOICES, default="auto",
                        help="device: batches sliced from the training data held on the device (tasks in memory "
                        "that fit); loader: a DataLoader; auto: device where it applies")
    parser.add_argument("--amp", choices=AMP_CHOICES, default="auto",
                        help="bf16: autocast the forward pass to bfloat16; auto: bf16 on CUDA, off on the CPU")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (after a first slow step)")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                        help="torch.compile's mode: reduce-overhead replays each step as CUDA graphs (one "
                        "process with --hook allreduce, where no DDP buckets break the graph)")
    parser.add_argument("--channels-last", action="store_true",
                        help="channels-last memory format for convolutional models (faster on tensor cores)")
    parser.add_argument("--out", required=True, help="output directory (checkpoint, metrics, model.pt)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    args = parser.parse_args(argv)
    # Refused here, before any rank joins the process group or loads data.
    if args.local_sgd and args.hook != "allreduce":
        parser.error("--local-sgd replaces gradient communication: it cannot be combined with --hook")
    if args.local_sgd == 1:
        parser.error("--local-sgd 1 would average every step: use plain allreduce instead")
    return args


class DeviceError(ValueError):
    """The processes asked for cannot each have the device they need; says what to run instead."""


def choose_device(choice: str, local_rank: int, local_world: int, gpus: int) -> tuple[torch.device, str]:
    """(device, backend) for the process of ``local_rank`` among ``local_world`` on a machine with
    ``gpus`` CUDA devices: one GPU per process with NCCL, or the CPU with gloo. Two processes on one
    GPU would fight over it (and NCCL refuses them); rank 1 of two on a one-GPU machine used to ask
    for ``cuda:1`` and crash, so that is refused here, before any process group, with what to run."""
    if choice not in DEVICE_CHOICES:
        raise DeviceError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")
    if choice == "cpu" or (choice == "auto" and gpus == 0):
        return torch.device("cpu"), "gloo"
    if gpus == 0:
        raise DeviceError("--device cuda, but this machine has no CUDA device; use --device cpu (gloo)")
    if local_world > gpus:
        raise DeviceError(f"{local_world} processes on this node but {gpus} GPU{'s' if gpus > 1 else ''}: run "
                          f"--nproc-per-node {gpus} (one process per GPU), or --device cpu for {local_world} "
                          "gloo processes on the CPU")
    return torch.device("cuda", local_rank), "nccl"


def _setup(choice: str = "auto") -> tuple[int, int, torch.device, str]:
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if "RANK" not in os.environ:  # plain `python -m fedge.deploy.train`: a world of one
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    device, backend = choose_device(choice, local_rank, local_world, gpu_count())
    dist.init_process_group(backend=backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device, backend


def not_learning(accuracies: list[float], chance: float | None, train_loss: float, epoch: int,
                 warmed_up: bool) -> str | None:
    """Why a run should stop rather than go on (None: it is learning). A learning rate scaled past
    what the model takes (``--batch-size 256`` with the defaults: 0.4) ends at chance, and the run
    used to finish and save that model: a non-finite loss, held-out accuracy back at chance after it
    had learned, or still at chance two epochs after the warm-up, stops it. ``chance``: always
    answering the held-out set's most common class (None: no accuracy to watch)."""
    if not math.isfinite(train_loss):
        return f"the training loss is {train_loss}"
    if chance is None or not accuracies:
        return None
    current, best = accuracies[-1], max(accuracies)
    if best > chance + 0.05 and current <= chance + 0.01:
        return (f"held-out accuracy fell back to chance ({current:.3f}; one class for everything scores "
                f"{chance:.3f}) after reaching {best:.3f}")
    if warmed_up and epoch >= 2 and best <= chance + 0.01:
        return f"held-out accuracy is still at chance ({current:.3f}) after {epoch + 1} epochs"
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def needs_ddp(world: int, hook: str) -> bool:
    """Whether the model trains inside DistributedDataParallel: always but for one process with
    plain allreduce, where DDP would change nothing in the gradients (a test checks the digests)."""
    return world > 1 or hook != "allreduce"


def _register_hook(model: DistributedDataParallel, spec: str, backend: str, buckets: int) -> Any:
    """Install the requested gradient communication; return its state (None for built-ins)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

    from fedge.compression import make_codec
    from fedge.compression.spec import parse_spec

    name, params = parse_spec(spec)
    if name == "allreduce":
        return None
    if name == "local-sgd":
        # Gradients are allreduced during the warm-up, then not at all: the models drift apart for
        # `period` steps and PeriodicModelAverager (after optimizer.step) averages them.
        state = post_localSGD_hook.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=int(params["warmup"]),
            post_local_gradient_allreduce=False,
        )
        model.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        return state
    if name == "fp16":
        # bf16 keeps fp32's range; PyTorch's bf16 hook needs NCCL, gloo gets fp16.
        hook = default_hooks.bf16_compress_hook if backend == "nccl" else default_hooks.fp16_compress_hook
        model.register_comm_hook(None, hook)
        return None
    if name == "powersgd":
        if backend == "gloo" and buckets > 1:
            raise SystemExit(
                f"PowerSGD on gloo needs a single gradient bucket, the model has {buckets}: raise "
                "--bucket-cap-mb above the gradient size (several buckets break on gloo, pytorch#58467)"
            )
        start = int(params.get("start", 2))
        if start < 2:
            raise SystemExit("powersgd start must be > 1 (the first iterations must be plain allreduce)")
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(params.get("rank", 2)),
            start_powerSGD_iter=start, min_compression_rate=0.0,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    from fedge.deploy.comm_hooks import CodecHookState, codec_hook

    state = CodecHookState(codec=make_codec(spec))
    model.register_comm_hook(state, codec_hook)
    return state


def _parameter_digest(model: nn.Module) -> str:
    import xxhash

    hasher = xxhash.xxh3_64()
    for tensor in model.state_dict().values():
        hasher.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def _averagings(averager: Any, step: int) -> int:
    """How many model averagings PeriodicModelAverager has done in the first ``step`` steps."""
    if averager is None or step <= averager.warmup_steps:
        return 0
    return (step - averager.warmup_steps - 1) // averager.period + 1


def _gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from fedge.tasks import chance_accuracy, evaluate, make_task

    try:
        rank, world, device, backend = _setup(args.device)
    except DeviceError as err:
        log.error("%s", err)
        return 2
    out = Path(args.out)
    task = make_task(args.task)
    torch.manual_seed(args.seed)
    model = task.build_model().to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    gradient_mb = _gradient_bytes(model) / 2**20
    buckets = max(1, math.ceil(gradient_mb / args.bucket_cap_mb))
    hook_spec = (f"local-sgd:period={args.local_sgd},warmup={args.local_sgd_warmup}" if args.local_sgd
                 else args.hook)
    # One process with plain allreduce: DDP would add its reducer and a one-rank allreduce to every
    # step and nothing else (the gradients are the same), and its buckets break torch.compile's
    # graph, which CUDA graphs (--compile-mode reduce-overhead) need whole. On one H200 a step took
    # about 3 ms at batch 256 and at 1024 alike: the host's launches set the pace there.
    alone = not needs_ddp(world, hook_spec)
    ddp: nn.Module = model if alone else DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    hook_state = None if alone else _register_hook(ddp, hook_spec, backend, buckets)  # type: ignore[arg-type]
    forward = torch.compile(ddp, mode=args.compile_mode) if args.compile else ddp

    global_batch = args.batch_size * world
    peak_lr = peak_rate(args.lr, global_batch, args.base_batch)
    warmup = args.warmup_steps
    optimizer: torch.optim.Optimizer = torch.optim.SGD(ddp.parameters(), lr=peak_lr, momentum=args.momentum)
    averager = None
    if args.local_sgd:
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        # The data-centre twin of FedAvg: each replica takes `period` local steps, then all models
        # are averaged (one dense allreduce of the parameters instead of `period` gradient ones).
        averager = PeriodicModelAverager(period=args.local_sgd, warmup_steps=args.local_sgd_warmup)
        optimizer = PostLocalSGDOptimizer(optim=optimizer, averager=averager)
    dataset = task.train_pool()  # any map-style Dataset of (input, target) pairs
    held_out = task.test_data()  # None: the task has no central split; epochs report training loss only

    def measure() -> dict[str, float]:
        """The task's held-out loss (``test_loss``) and metrics, e.g. ``accuracy`` or ``mse``."""
        if held_out is None:
            return {}
        figures = evaluate(model, held_out, task)
        return {"test_loss": figures.pop("loss"), **figures}

    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    try:
        loader, data_path = make_batches(args.data, dataset, sampler, args.batch_size, device, args.channels_last)
    except ValueError as err:
        log.error("%s", err)
        dist.destroy_process_group()
        return 2
    use_autocast = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")
    if args.compile:  # a compiler that gets this model's gradients wrong must not train it
        refusal = [None]
        if rank == 0:
            x, y = next(iter(loader))
            x, y = to_device(x, device), to_device(y, device)
            if args.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            wrong = compiled_gradient_error(model, task.loss, x, y, mode=args.compile_mode, autocast=use_autocast)
            if wrong is not None:
                refusal = [f"torch.compile computes this model's gradients wrongly on {device.type} (torch "
                           f"{torch.__version__}): {wrong[0]} is off by {wrong[1]:.2f} of its norm on the first "
                           f"batch (a compiler bug); run without --compile"]
        dist.broadcast_object_list(refusal, src=0)
        if refusal[0] is not None:
            log.error("%s", refusal[0])
            dist.destroy_process_group()
            return 2

    step, first_epoch = 0, 0
    checkpoint_path = out / "checkpoint.pt"
    if args.resume and checkpoint_path.exists():
        saved = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step, first_epoch = int(saved["step"]), int(saved["epoch"]) + 1
        log.info("rank %d resumed after epoch %d (step %d)", rank, first_epoch - 1, step)

    targets = getattr(held_out, "y", None)  # in-memory held-out data: the accuracy a model at chance has
    chance = chance_accuracy(task, targets) if rank == 0 and targets is not None else None
    accuracies: list[float] = []
    stopped: str | None = None
    metrics = out / "metrics.jsonl"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            metrics.unlink(missing_ok=True)
    gpu_timed = device.type == "cuda"  # each step's span on the GPU's own clock (gpu_span)
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        seen, loss_sum, compute_s, total_s = 0, 0.0, 0.0, 0.0
        bytes_before = getattr(hook_state, "bytes_sent", 0)
        averaged_before = _averagings(averager, step)
        epoch_steps, data_s, spans = 0, 0.0, []
        epoch_started = fetched = time.perf_counter()
        loss_total = torch.zeros((), device=device)
        for x, y in loader:
            if args.max_steps and step >= args.max_steps:
                break
            started = time.perf_counter()
            data_s += started - fetched
            for group in optimizer.param_groups:  # linear warm-up to the scaled rate
                group["lr"] = peak_lr * min(1.0, (step + 1) / max(1, warmup))
            x, y = to_device(x, device), to_device(y, device)
            if args.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            if gpu_timed:
                spans.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                spans[-1][0].record()
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_autocast):
                loss = task.loss(forward(x), y)
            forward_done = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # gradient communication overlaps with this call
            optimizer.step()
            if gpu_timed:
                spans[-1][1].record()
            fetched = time.perf_counter()
            compute_s += forward_done - started
            total_s += fetched - started
            seen += x.shape[0] * world
            loss_total += loss.detach()  # read once per epoch: a .item() per step waits for the GPU
            step += 1
            epoch_steps += 1
        loss_sum = float(loss_total)  # waits for the epoch's last step
        wall_s = time.perf_counter() - epoch_started
        # from each step's first to its last GPU event, idle gaps between launches included
        gpu_span = sum(a.elapsed_time(b) for a, b in spans) / 1000 / wall_s if spans and wall_s else None
        # held-out evaluation and writes happen on rank 0 only
        if rank == 0:
            measured = measure()
            payload_bytes = getattr(hook_state, "bytes_sent", 0) - bytes_before
            averagings = _averagings(averager, step) - averaged_before
            row = {
                "epoch": epoch, "step": step, "world_size": world, "backend": backend, "hook": hook_spec,
                "train_loss": loss_sum / max(1, epoch_steps), **measured,
                # over the epoch's wall time, data included (host time alone flatters an asynchronous GPU)
                "samples_per_s": seen / wall_s if wall_s and seen else None,
                "data": data_path, "amp": "bf16" if use_autocast else "off", "compiled": args.compile,
                "data_wait_s": data_s / max(1, epoch_steps), "gpu_span": gpu_span,
                "step_s": total_s / max(1, epoch_steps),
                "forward_s": compute_s / max(1, epoch_steps),
                "backward_comm_optimizer_s": (total_s - compute_s) / max(1, epoch_steps),
                # Fedge codecs count their encoded bytes; local SGD sends one dense copy of the
                # parameters per averaging; PyTorch's own hooks do not expose a count.
                "payload_bytes_per_step": payload_bytes / max(1, epoch_steps) if hasattr(hook_state, "bytes_sent")
                else averagings * _gradient_bytes(model) / max(1, epoch_steps) if averager is not None else None,
                "dense_gradient_bytes_per_step": _gradient_bytes(model),
                "model_averagings": averagings if averager is not None else None,
                "lr": optimizer.param_groups[0]["lr"],
            }
            with open(metrics, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
            atomic_torch_save(checkpoint_path, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "epoch": epoch,
            })
            log.info("epoch %d: loss %.4f %s %.0f samples/s", epoch, row["train_loss"],
                     " ".join(f"{k} {v:.4f}" for k, v in measured.items()), row["samples_per_s"] or 0)
            if "accuracy" in measured:
                accuracies.append(float(measured["accuracy"]))
            why = not_learning(accuracies, chance, float(row["train_loss"]), epoch, step >= warmup)
            if why is not None and args.base_batch:
                stopped = (f"stopped at epoch {epoch}: the model is not learning: {why}. The learning rate is "
                           f"{peak_lr:g} = --lr {args.lr:g} x global batch {global_batch} / --base-batch "
                           f"{args.base_batch}: lower --lr, set --base-batch {global_batch} (the batch --lr is "
                           f"meant for) or leave it out (no scaling), or lengthen --warmup-steps ({warmup})")
            elif why is not None:
                stopped = (f"stopped at epoch {epoch}: the model is not learning: {why}. The learning rate is "
                           f"--lr {peak_lr:g} at a global batch of {global_batch}: lower --lr, or lengthen "
                           f"--warmup-steps ({warmup})")
        decision = [stopped]
        dist.broadcast_object_list(decision, src=0)  # every rank stops together
        stopped = decision[0]
        dist.barrier()
        if stopped is not None or (args.max_steps and step >= args.max_steps):
            break

    if averager is not None:
        # A last average so that every replica ends with the same model, whatever the step count.
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        average_parameters(iter(model.parameters()), dist.group.WORLD)
    # Release DDP (its reducer and any comm-hook state) before the process group goes away: tearing
    # the group down under a live reducer aborted a rank at exit ("terminate called without an
    # active exception") in about one run in ten here.
    del ddp, hook_state
    gc.collect()
    # Replicas must hold identical parameters: every rank hashes its own, rank 0 records them all.
    digests: list[str | None] = [None] * world
    dist.all_gather_object(digests, _parameter_digest(model))
    if rank == 0 and stopped is not None:  # no model.pt: nothing downstream may start from it
        log.error("%s", stopped)
        atomic_write_text(out / "summary.json", json.dumps(
            {"stopped": stopped, "steps": step, "world_size": world, "hook": hook_spec, "backend": backend,
             "parameter_digests": digests, "replicas_identical": len(set(digests)) == 1}, indent=2) + "\n")
    elif rank == 0:
        measured = measure()
        save_model_file(out / "model.pt", ModelFile(
            task=task.spec, state_dict=model.state_dict(),
            metadata={"source": "fedge.deploy.train", **measured, "steps": step, "world_size": world,
                      "hook": hook_spec, "backend": backend},
        ))
        atomic_write_text(out / "summary.json", json.dumps(
            {**measured, "steps": step, "world_size": world,
             "hook": hook_spec, "backend": backend, "parameter_digests": digests,
             "replicas_identical": len(set(digests)) == 1}, indent=2) + "\n")
        if len(set(digests)) != 1:
            log.error("replicas diverged: parameter digests %s", digests)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    return 3 if stopped is not None else 0


if __name__ == "__main__":
    sys.exit(main())
