"""A leaf coordinator: Fedge's engine over one leaf's devices, one step per root round.

Beyond one SuperLink, the devices connect to leaves (each a SuperLink with its devices) and the
root's nodes are the leaves' bridges (``fedge.edge_client.bridge``). For each root round the bridge
hands the root's model to its leaf; the leaf makes it its algorithm's model, runs ``rounds`` steps
of its own with its devices (HierFAVG's κ2; each step through the engine's whole door: its own
downlink versions, layers, metrics row and atomic checkpoint, so a restarted leaf resumes where its
checkpoint left), and answers with the change of its model, the weight and the device count of its
steps. The bridge sends that change up as a device sends its update, so the root is Fedge's
engine unchanged: FedAvg over leaves weighted by their examples is FedAvg over all their devices
(``tests/server/test_leaf.py``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from fedge.deploy.atomic import atomic_write_bytes
from fedge.coordinator.dp_mechanisms import LeafClip
from fedge.coordinator.layer import LayerStack
from fedge.coordinator.root_round_layer import RootRoundStamp
from fedge.protocol.leaf import (
    HEARTBEAT,
    HEARTBEAT_EVERY,
    LeafResult,
    LeafSpoolError,
    RootOrigin,
    decode_request,
    encode_result,
    result_name,
)
from fedge.server.engine.loop import Engine
from fedge.deploy.owned_directory import owned_directory

__all__ = ["LeafCoordinator", "LeafError", "heartbeat"]

log = logging.getLogger(__name__)


#: the beating process: touches the file every ``every`` seconds for as long as the process that
#: started it lives (its parent changes when that one dies), then exits; nothing but the standard
#: library, and no site or user path (``-I -S``)
_BEAT = """
import os, sys, time
path, every, parent = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
while os.getppid() == parent:
    try:
        os.utime(path)
    except FileNotFoundError:
        open(path, "a").close()
    except OSError:
        pass
    time.sleep(every)
"""


@contextmanager
def heartbeat(path: Path, every: float) -> Iterator[None]:
    """Touch ``path`` every ``every`` seconds while the block runs, from a small process of its own:
    the leaf's bridge reads it to tell a leaf that is stepping from one that is down. A process, not
    a thread: a thread of the leaf's process waits for its interpreter, and a simulated leaf's
    process, loaded on 2 cores while its Ray instance started, once let its heartbeat thread go 10 s
    without running (its bridge gave it up as down in the middle of its step). The beater stops when
    the block ends or the leaf's process dies; the file is left in place, so it goes stale."""
    try:
        path.touch()  # the first beat before the block runs
    except OSError as err:  # a full disk must not stop the leaf; its bridge may then give up early
        log.warning("leaf heartbeat %s: %s", path, err)
    beater = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BEAT, str(path), repr(float(every)),
                               str(os.getpid())], stdin=subprocess.DEVNULL)
    try:
        yield
    finally:
        beater.terminate()
        try:
            beater.wait(timeout=10)
        except subprocess.TimeoutExpired:
            beater.kill()
            beater.wait()


class LeafError(ValueError):
    """A leaf that cannot serve a root: an algorithm whose model the root cannot set."""


class LeafCoordinator:
    """``engine`` over ``grid`` (the leaf's devices), driven by its root (see the module docstring)."""

    def __init__(self, engine: Engine, grid: object, rounds: int = 1) -> None:
        algorithm = engine.algorithm
        if algorithm.name != "fedavg" or algorithm.asynchronous:
            raise LeafError(f"a leaf runs FedAvg steps from the root's model; {algorithm.spec!r} keeps a model of "
                            "its own (hierarchical EASGD, gossip or asynchronous leaves are not built)")
        if rounds < 1:
            raise LeafError(f"a leaf runs at least one step per root round, got {rounds}")
        self.engine, self.grid, self.rounds = engine, grid, rounds
        self.steps: int | None = None  # the leaf's own step count (restored from its checkpoint)
        self.stamp = RootRoundStamp()
        engine.layers = LayerStack([*engine.layers, self.stamp])

    def step(self, root_round: int, model: torch.Tensor, origin: RootOrigin | None = None) -> LeafResult:
        """``rounds`` leaf steps from the root's ``model``; the change, its weight and its count.
        ``origin`` (the root's run and this leaf's index, from the bridge) is stamped on every train
        message of these steps."""
        model = model.to(torch.float32)
        self.stamp.current = None if origin is None else (f"{origin.run}/{root_round}", origin.leaf)
        if self.steps is None:  # a fresh leaf starts from the root's first model; a restarted one resumes
            self.steps = self.engine.begin(model)
            self.engine.wait_for_nodes(self.grid)  # its devices, as a run waits before its first step
        self.engine.algorithm.start(model)
        weight, count, losses, connected, empty = 0.0, 0, [], 0, False
        # central DP samples a leaf's devices by Poisson draws: an empty draw is an answer (an empty sum)
        poisson = isinstance(getattr(self.engine.layer("dp"), "mechanism", None), LeafClip)
        for _ in range(self.rounds):
            self.steps += 1
            closed = self.engine.run_step(self.grid, self.steps)
            row = self.engine.publish(self.grid, closed, None)
            released = closed.step.released
            connected = closed.step.connected
            if released is not None:
                weight, count = released.weight, released.count  # the last step's devices
            empty = poisson and row.clients_sampled == 0
            if closed.outcome.train_loss is not None:
                losses.append(closed.outcome.train_loss)
            log.info("leaf step %d for root round %d: %d devices, weight %g", row.round, root_round, count, weight)
        final = self.engine.algorithm.final_model()
        delta = final - model
        if self.rounds == 1 and released is not None and not released.is_empty:
            # One step that applied its mean at rate 1 (plain FedAvg): that mean is the change, bit
            # for bit, where final - model can round off by an ulp. Sent as is, the root over one
            # leaf reproduces the flat run's model exactly.
            applied = released.mean()
            if torch.equal(model + applied, final):
                delta = applied
        return LeafResult(delta=delta, weight=weight, count=count,
                          train_loss=sum(losses) / len(losses) if losses else None, connected=connected,
                          empty_sample=empty and count == 0)

    def serve(self, spool: str | Path, stop: Callable[[], bool], poll: float = 0.05,
              sleep: Callable[[float], None] = time.sleep) -> int:
        """Answer the bridge's requests in ``spool`` until ``stop()``; the steps answered. Only the
        newest round without a result is served (an older one's root round is over), and a round
        with a result is never stepped again: a leaf that crashed between its step and its answer
        runs that round's step afresh from the root's model, so the root counts it once."""
        spool = owned_directory(spool)  # only this user may write it (privacy audit 3, F9)
        with heartbeat(spool / HEARTBEAT, HEARTBEAT_EVERY):  # the bridge tells a busy leaf from a dead one
            return self._serve(spool, stop, poll, sleep)

    def _serve(self, spool: Path, stop: Callable[[], bool], poll: float, sleep: Callable[[float], None]) -> int:
        answered = 0
        while not stop():
            pending = sorted(p for p in spool.glob("request-*.pt")
                             if not (spool / p.name.replace("request-", "result-")).exists())
            if not pending:
                sleep(poll)
                continue
            newest = pending[-1]
            try:
                root_round, model, origin = decode_request(newest.read_bytes(), self.engine.ctx.numel)
            except LeafSpoolError as err:  # a foreign or truncated file: logged, left, never stepped on
                log.error("leaf spool: %s: %s", newest.name, err)
                newest.rename(newest.with_suffix(".refused"))
                continue
            result = self.step(root_round, model, origin)
            atomic_write_bytes(spool / result_name(root_round), encode_result(root_round, result))
            answered += 1
            for old in [*spool.glob("request-*.pt"), *spool.glob("result-*.pt")]:  # the last two rounds stay
                number = old.stem.partition("-")[2]
                if number.isdigit() and int(number) < root_round - 1:
                    old.unlink(missing_ok=True)
        return answered
