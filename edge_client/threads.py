"""A node's CPU budget for training, as a Flower mod: node config ``threads=N`` (default 1).

torch starts one intra-op thread per core in every process. On the deployment engine every message
runs in a fresh ClientApp process next to the SuperNode (and, on a shared host, next to other
nodes), so the default oversubscribes the cores: on this 2-core machine two SuperNodes' rounds took
24-36 s with torch's default and 14 s with one thread each (``fedge local-cluster --supernodes 2
--rounds 3``, 2026-11-23, before and after ``OMP_NUM_THREADS=1``; a py-spy profile of one ClientApp
showed 25 s of its 33 s in backward passes of a 38k-parameter CNN). A device that wants more (and has the cores) says so:
``fedge-edge join --threads 4``. The simulation engine already pins each worker to its CPU share.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

__all__ = ["threads_mod", "threads_of"]

DEFAULT_THREADS = 1


def threads_of(context: Context) -> int:
    value = context.node_config.get("threads", DEFAULT_THREADS)
    try:
        threads = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"node config threads must be a positive integer, got {value!r}") from None
    if threads < 1:
        raise ValueError(f"node config threads must be a positive integer, got {value!r}")
    return threads


def threads_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    import torch

    threads = threads_of(context)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return call_next(msg, context)
