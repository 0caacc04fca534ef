"""The round engine: the lifecycle every algorithm shares, over Flower's ``Grid``.

Per run: resume from the run directory's checkpoint (or start the algorithm and its layers fresh),
wait for nodes, then run steps. Every step, synchronous or asynchronous, secure or clear, is one
sequence:

1. **open**: select nodes (a seeded sample, or a layer's: Poisson under DP, which ends the run when
   its budget is spent), let the algorithm open the step, then the layers (secure aggregation's
   key agreement, over the step's exchange, narrows the step's nodes);
2. **send**: the algorithm's messages, passed through every layer (the downlink ships the model,
   DP stamps the clipping bound, secure aggregation staples its plan);
3. **receive**: each reply the moment it is pulled, through one door (:meth:`Engine.absorb_reply`):
   screen → metrics → every layer's ``arrived`` (one may take a reply whole: a masked upload) → the
   algorithm's admission → decode with the codec of its round → layers (the guard's bound and
   weight, DP's clip) → the algorithm. Timeouts, client errors, refusals and rejected replies become typed
   :class:`~fedge.server.engine.layers.Failure` entries, counted by kind;
4. **close** (:meth:`Engine.close`): the step's aggregate, one typed
   :class:`~fedge.aggregation.partial.Partial`, passes every layer's ``release`` (secure
   aggregation unmasks the survivors' sum, DP noises it), the algorithm closes from it, layers
   close (ledger, downlink tally, guard report, model average);
5. **publish** (:meth:`Engine.publish`): measure the step's model on held-out data or on devices,
   write one metrics row, then an atomic checkpoint, in that order (after a crash in between, the
   step runs again and its row is replaced). Closing and publishing are apart so that a step can
   be closed without being published (a leaf coordinator forwards ``step.released``).

The synchronous loop runs 1-4 once per round; the asynchronous loop keeps nodes busy, receives
replies as they land and concludes a step whenever the algorithm is ready. ``uplink_bytes`` are the
bytes of the ``update`` record of every reply that arrived, used or refused (the real encoded
payloads, headers included; ``protocol.tally``) plus layers' own exchanges, ``measurement_bytes``
those of ``measure`` records, ``downlink_bytes`` every array sent.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from fedge.compression import derive_seed
from fedge.protocol import UPDATE_RECORD, array_bytes, read_payload
from fedge.coordinator.driver import StepDriver
from fedge.server.engine.algorithm import (
    Algorithm,
    Outgoing,
    Reply,
    RunContext,
    Step,
    StepOutcome,
    Update,
    reply_metrics,
)
from fedge.coordinator.async_loop import AsyncLoop
from fedge.coordinator.dispatcher import grid_exchange
from fedge.coordinator.step import Missing
from fedge.server.engine.evaluation import FederatedEvaluation, evaluation_mode
from fedge.coordinator.layer import LayerStack, RunComplete
from fedge.server.engine.layers import Exchange, Failure, Layer, build_layers
from fedge.coordinator.downlink_layer import DownlinkLayer
from fedge.server.engine.reply_screen import screen_reply
from fedge.server.engine.roster import Roster
from fedge.server.run.device_ledger import DeviceLedger
from fedge.coordinator.tally import Tally, resource_summary
from fedge.server.run.checkpoint import Checkpoint, CheckpointError, IncompatibleCheckpointError
from fedge.server.run.metrics_row import RoundRow
from fedge.server.run.run_directory import RunDirectory
from fedge.server.settings import RunSettings, SettingsError
from fedge.tasks import Task, numel_of
from fedge.tasks.parameters import model_digest
from fedge.tasks.data_files import load_npz

__all__ = ["ClosedStep", "Engine", "EngineResult", "NotEnoughNodesError", "make_context", "sample_nodes"]

log = logging.getLogger(__name__)


class NotEnoughNodesError(RuntimeError):
    """Fewer SuperNodes than the run needs connected within ``wait-for-nodes`` seconds."""


@dataclass
class EngineResult:
    model: torch.Tensor
    rows: list[RoundRow] = field(default_factory=list)
    resumed_from: int = 0
    #: the run ended early because the operator asked (``fedge serve`` on SIGTERM); resumable
    stopped: bool = False
    #: the run ended complete before its last round because a row reached ``stop-accuracy``
    reached_target: bool = False
    #: the run ended complete before its last round because its privacy budget was spent
    budget_spent: bool = False


def make_context(settings: RunSettings, task: Task) -> RunContext:
    """The run's context: the model layout, and where step models are measured (the operator's
    ``eval-data`` file replaces the task's central split; ``evaluate`` picks central or federated)."""
    template = task.build_model().state_dict()
    central = load_npz(settings.eval_data, task) if settings.eval_data else task.test_data()
    try:
        mode = evaluation_mode(settings.evaluate, central is not None)
    except ValueError as err:
        raise SettingsError(str(err)) from None
    rule = settings.stop_rule
    if rule is not None and rule[0] != "loss":
        known = set(task.metrics(*_probe(task)))
        if rule[0] not in known:
            raise SettingsError(f"stop-at names {rule[0]!r}; task {task.spec!r} reports loss, {', '.join(sorted(known))}")
    return RunContext(
        settings=settings, task=task, template=template, numel=numel_of(template),
        fp32_bytes=sum(len(a.data) for a in ArrayRecord(template).values()),
        nodes_expected=settings.clients_per_round, central_data=central, evaluation=mode,
    )


def _probe(task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    """One real sample's output and target: what a task's metric names are learnt from."""
    from fedge.tasks import predict
    from fedge.tasks.base import subset

    pool = task.test_data()
    pool = pool if pool is not None and len(pool) else task.train_pool()  # type: ignore[arg-type]
    return predict(task.build_model(), subset(pool, [0]))


def sample_nodes(nodes: list[int], count: int, seed: int, step: int) -> list[int]:
    """``count`` of ``nodes``, drawn from (seed, step) alone: a resumed run samples exactly as an
    uninterrupted one. ``nodes`` come in the run's canonical order (:class:`Roster`: by partition,
    so the same seed draws the same partitions whatever numbers Flower gave the nodes); the sample
    keeps that order. Node ids are unsigned 64-bit: pick positions, never pass ids through numpy."""
    nodes = list(nodes)
    count = min(count, len(nodes))
    rng = np.random.default_rng(derive_seed(seed, step, purpose="sample"))
    return [nodes[int(i)] for i in sorted(rng.choice(len(nodes), size=count, replace=False))]


@dataclass
class ClosedStep:
    """A step closed but not yet published: its accumulators (``step.released``: the partial
    aggregate it released), how it ended, its accounting, and the devices that evaluate its model."""

    step: Step
    outcome: StepOutcome
    tally: Tally
    evaluators: list[int]


class Engine:
    def __init__(
        self,
        algorithm: Algorithm,
        run_dir: RunDirectory,
        on_row: Callable[[RoundRow], None] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.algorithm = algorithm
        self.ctx = algorithm.ctx
        self.settings = algorithm.ctx.settings
        self.run_dir = run_dir
        self.on_row = on_row
        self.clock = clock
        self.sleep = sleep
        #: the cross-cutting features around every step (``fedge.server.engine.layers``), in order
        self.layers = LayerStack(build_layers(algorithm, run_dir))
        #: added to the clock for a row's wall_seconds: this run's time across restarts (set by run)
        self._wall = 0.0
        #: each node's stable name: every seeded choice sees the nodes in its order
        self.roster = Roster()
        self.devices = DeviceLedger(run_dir.path / "devices.json")

    def layer(self, key: str) -> Layer | None:
        """The run's layer named ``key`` (``dp``, ``downlink``, ...), or None when it is off."""
        return self.layers.get(key)

    # -- public ---------------------------------------------------------------------------------
    def begin(self, initial_params: torch.Tensor) -> int:
        """Start the run from ``initial_params``, or resume it from its checkpoint, and describe it;
        the number of the last step done. :meth:`run` begins so; a run driven from outside step by
        step (a leaf coordinator, ``fedge.server.leaf``) calls it, then :meth:`run_step` and
        :meth:`publish`."""
        start = self._restore(initial_params)
        rows = self.run_dir.metrics.read()
        # wall_seconds counts this run's time, across restarts (a restart's downtime is not counted)
        self._wall = (float(rows[-1].get("wall_seconds", 0.0)) if rows else 0.0) - self.clock()
        self.run_dir.write_description({**self.algorithm.describe(), **self.layers.describe()})
        return start

    def run(self, grid: object, initial_params: torch.Tensor) -> EngineResult:
        start = self.begin(initial_params)
        rows = [RoundRow.from_json(r) for r in self.run_dir.metrics.read()]
        result = EngineResult(model=self._final_model(), rows=rows, resumed_from=start)
        if start >= self.settings.rounds or self._reached_target(result):
            log.info("run already complete (%d rounds)", start)
            return result
        try:
            nodes = self.wait_for_nodes(grid)
        except _StopWhileWaiting:
            log.info("stop requested while waiting for nodes; nothing to checkpoint")
            result.stopped = True
            return result
        log.info("%s: %d nodes connected; rounds %d..%d", self.algorithm.spec, len(nodes), start + 1,
                 self.settings.rounds)
        if self.algorithm.asynchronous:
            self._run_async(grid, start, result)
        else:
            for step in range(start + 1, self.settings.rounds + 1):
                try:
                    self.step(grid, step, result)
                except RunComplete as why:  # raised while choosing the step's nodes: nothing was sent
                    log.info("run complete after round %d: %s", step - 1, why)
                    result.budget_spent = True
                    break
                if self._reached_target(result) or self._stop_requested(result):
                    break
        result.model = self._final_model()
        return result

    def step(self, grid: object, number: int, result: EngineResult | None = None) -> RoundRow:
        """One synchronous step: :meth:`run_step`, then :meth:`publish`."""
        closed = self.run_step(grid, number)
        return self.publish(grid, closed, result)

    def run_step(self, grid: object, number: int) -> ClosedStep:
        """One synchronous step up to its close, unpublished: open, send, absorb every reply as it
        lands, :meth:`close`. (A leaf coordinator would forward ``step.released`` from here.)"""
        tally = Tally(self.clock())
        exchange = self._exchange(grid, number)
        nodes = self.connected(grid, number)
        if self.algorithm.fixed_membership and len(nodes) < self.algorithm.nodes_needed():
            self.wait_for_nodes(grid)  # a member left: wait for it (NotEnoughNodesError after wait-for-nodes)
            nodes = self.connected(grid, number)
        selected = self.algorithm.select(number, nodes, self.sample)
        driver = self._open(number, selected, len(nodes), exchange, tally)
        outgoing = self._send(driver, driver.step.nodes)
        tally.sampled = len(selected)  # those a layer dropped before training were sampled too
        for item in exchange(outgoing, self.settings.round_timeout, "train"):
            self._take(driver, item)
        # the order of arrival is the one thing a run of the same seed may not reproduce (and need not)
        log.info("round %d: used replies arrived from partitions %s", number,
                 [self.roster.name(n) for n in tally.members])
        return ClosedStep(driver.step, self.close(driver), tally, selected)

    def connected(self, grid: object, number: int) -> list[int]:
        """The connected nodes in the run's canonical order, after asking the new ones their name
        (the roll call, :class:`Roster`)."""
        nodes = list(grid.get_node_ids())  # type: ignore[attr-defined]
        self.roster.learn(nodes, self._exchange(grid, number), self.settings.round_timeout)
        return self.roster.order(nodes)

    def sample(self, nodes: list[int], step: int) -> list[int]:
        """The nodes of a sampled step: a layer's sample (Poisson under DP) or the seeded one."""
        return self._choose(nodes, self.settings.clients_per_round, step)

    def _choose(self, nodes: list[int], count: int, key: int) -> list[int]:
        """``count`` of ``nodes``: the first layer's choice (Poisson under DP, Oort), else a seeded
        sample drawn from (seed, key) alone."""
        chosen = self.layers.select(nodes, count, key)
        return chosen if chosen is not None else sample_nodes(nodes, count, self.settings.seed, step=key)

    def close(self, driver: StepDriver) -> StepOutcome:
        """Close a step without publishing it: the step's aggregate passes every layer's ``release``
        (``step.released``: what a leaf coordinator would forward), the algorithm closes from it,
        layers close. Nothing is measured, written or checkpointed here."""
        step = driver.step
        if step.aggregate is not None:
            driver.release(step.aggregate.partial())
        outcome = self.algorithm.close(step)
        driver.close(outcome)
        return outcome

    def publish(self, grid: object, closed: ClosedStep, result: EngineResult | None) -> RoundRow:
        """Publish a closed step: measure its model (central or federated, on ``closed.evaluators``),
        write one metrics row, then the checkpoint."""
        step, outcome, tally, evaluators = closed.step, closed.outcome, closed.tally, closed.evaluators
        metrics, extra = self.measure(grid, step.number, outcome.model, evaluators, tally)
        if tally.train_seconds:
            extra["client_train_seconds"] = max(tally.train_seconds)
        if tally.resources:
            extra["device_resources"] = resource_summary(tally.resources)
        if self.algorithm.asynchronous:
            extra["client_idle_seconds"] = tally.idle
        extra.update(tally.by_kind())
        # the seed and the measured model's fingerprint: two runs of one seed compare these rows
        extra["seed"] = self.settings.seed
        if outcome.model is not None:
            extra["model_digest"] = model_digest(outcome.model)
        row = RoundRow(
            round=step.number, algorithm=self.algorithm.name, metrics=metrics, metric=self.ctx.task.primary_metric,
            evaluation="federated" if self.ctx.evaluation == "federated" else "central",
            train_loss=outcome.train_loss, uplink_bytes=tally.uplink, uplink_fp32_bytes=tally.uploads * self.ctx.fp32_bytes,
            downlink_bytes=tally.downlink, measurement_bytes=tally.measurement, seconds=self.clock() - tally.began,
            clients_sampled=tally.sampled, clients_used=tally.used, clients_failed=len(tally.rejected),
            clients_declined=sum(tally.declined.values()),
            codec=self.algorithm.codec.spec, rejected=self._in_roster_order(tally.rejected + outcome.notes),
            extra=self._nodes_in_roster_order({**outcome.extra, **extra}),
        )
        log.info("%s %d: %s %s %.4f loss %.4f | %d/%d clients | uplink %d B (fp32 %d B) | %.1f s",
                 "version" if self.algorithm.asynchronous else "round", step.number, row.evaluation, row.metric,
                 row.score, row.loss, tally.used, tally.sampled, tally.uplink, row.uplink_fp32_bytes, row.seconds)
        self._write(row, result)
        self.devices.record(step.number, step.nodes, tally, self.roster.name)  # for people watching (devices.json)
        return row

    def _in_roster_order(self, rejected: list[dict]) -> list[dict]:
        """A row's failures in an order that does not depend on arrival (the step's own notes first,
        then by node in the roster's order), each named by its partition where the node has one:
        Flower's node numbers are new in every simulation, partitions are not."""
        def key(entry: dict) -> tuple:
            node = entry.get("node")
            return ((0, 0, 0) if node is None else self.roster.key(node)), str(entry.get("kind")), str(entry.get("reason"))

        named = []
        for entry in sorted(rejected, key=key):
            name = None if entry.get("node") is None else self.roster.name(entry["node"])
            named.append(entry if name is None else {**entry, "partition": name})
        return named

    def _nodes_in_roster_order(self, extra: dict) -> dict:
        """Lists of nodes a row reports (``clipped_nodes``, ``chosen_nodes``, ...) in the roster's order."""
        for name, value in extra.items():
            if name.endswith("_nodes") and isinstance(value, list) and all(isinstance(n, int) for n in value):
                extra[name] = self.roster.order(value)
        return extra

    def absorb_reply(self, step: Step, reply: Reply) -> Update | None:
        """The one door of every update, secure or clear: screen the whole reply, check the metrics
        every reply carries, show it to every layer (one may take it whole: a masked upload), let
        the algorithm admit it, decode it with the codec of its round (validated in full before anything moves), pass
        it through the layers (bound, weight, clip) and hand it to the algorithm. Raises
        :class:`Rejected`, ``PayloadError`` or ``ProtocolError``. Returns the update the algorithm
        absorbed, or None when a layer took the reply whole."""
        alg = self.algorithm
        screen_reply(reply.content, self.ctx.fp32_bytes)
        metrics = reply_metrics(reply.content)
        payload = read_payload(reply.content, UPDATE_RECORD)

        def decode() -> Update:
            alg.admit(step, reply)
            codec = alg.reply_codec(step, reply)
            if codec.shares_support:  # tcs: on the support of the change this node's message carried
                downlink = self.layer("downlink")
                assert isinstance(downlink, DownlinkLayer)  # every run has one; it refused tcs without a lattice
                codec = downlink.bind(codec, reply.node)
            return Update(node=reply.node, vector=codec.decode(payload, self.ctx.numel), weight=1.0, metrics=metrics,
                          payload=bytes(payload), content=reply.content, started=reply.started)

        update = self.layers.through(step, reply, payload, metrics, decode)
        if update is not None:  # None: a layer consumed it whole (a masked upload)
            alg.absorb(step, update)
        return update

    def evaluate(self, params: torch.Tensor) -> dict[str, float]:
        """Loss and the task's metrics of a flat model on the coordinator's held-out data (empty
        when the run has none: it evaluates on the devices)."""
        return self.ctx.evaluate(params)

    def measure(self, grid: object, number: int, model: torch.Tensor | None, nodes: list[int],
                tally: Tally) -> tuple[dict[str, float], dict[str, object]]:
        """The step model's metrics for the row (central or federated, as the run says) and what
        the row records beside them (with ``both``: the federated figures as ``federated_<name>``)."""
        if model is None:
            return {}, {}
        mode = self.ctx.evaluation
        central = self.evaluate(model) if mode in ("central", "both") else {}
        due = number % self.settings.evaluate_every == 0 or number >= self.settings.rounds
        if mode == "central" or not due or not nodes:
            return central, {}
        federated = FederatedEvaluation(self.ctx, number)
        outgoing = federated.messages(model, nodes)
        tally.downlink += sum(array_bytes(o.content) for o in outgoing)
        def absorb(reply: Reply) -> None:  # the same door as an update's: screen first
            screen_reply(reply.content, self.ctx.fp32_bytes)
            federated.absorb(reply.node, reply.content)

        # the same door as an update's; its own tally (evaluation replies are not the step's uplink)
        evaluation = StepDriver(LayerStack(), Step(number), Tally(0.0), heard=federated.ignore)
        for item in self._exchange(grid, number)(outgoing, self.settings.round_timeout, "eval"):
            evaluation.take(item, absorb, what="evaluation")
        if mode == "federated":
            return federated.result(), federated.facts()
        return central, {**{f"federated_{k}": v for k, v in federated.result().items()}, **federated.facts()}

    # -- the asynchronous loop ------------------------------------------------------------------
    def _run_async(self, grid: object, start: int, result: EngineResult) -> None:
        """Asynchronous steps on the shared schedule (:class:`~fedge.coordinator.async_loop.AsyncLoop`):
        keep ``concurrency`` clients busy; whenever a reply lands, hand it to the algorithm and send
        that node's slot to a free node; conclude a step (a new model version) whenever the algorithm
        is ready. Messages still out when the last version is published are abandoned: their
        updates would train a finished model."""
        alg = self.algorithm
        loop = AsyncLoop(grid, alg.concurrency, self.settings.round_timeout, ttl=self._ttl, clock=self.clock,
                         sleep=self.sleep)
        free_since: dict[int, float] = {}  # node -> when its last reply landed
        version = start
        self.connected(grid, version + 1)  # the roll call: free nodes are picked in the roster's order
        driver = self._open(version + 1, [], len(grid.get_node_ids()), self._exchange(grid, version + 1),  # type: ignore[attr-defined]
                            Tally(self.clock()))

        def pick(free: list[int], want: int, dispatch: int) -> list[int]:
            # Seeded by the dispatch counter: which free nodes get the slots is reproducible for a
            # given order of replies (the order itself follows the devices' real speed).
            return self._choose(self.roster.order(free), want, 10**6 * (version + 1) + dispatch)

        def send(nodes: list[int]) -> list[Outgoing]:
            outgoing = self._send(driver, nodes)
            for o in outgoing:
                driver.tally.idle += max(0.0, self.clock() - free_since.pop(o.node, self.clock()))
            return outgoing

        def receive(node: int, began: int | None, item: Message | Missing) -> bool:
            nonlocal version, driver
            free_since[node] = self.clock()
            self._take(driver, item, started=began)
            if not alg.ready(driver.step):
                return False
            version += 1
            outcome = self.close(driver)
            self.publish(grid, ClosedStep(driver.step, outcome, driver.tally, self._evaluators(grid, version)), result)
            driver = self._open(version + 1, [], len(grid.get_node_ids()),  # type: ignore[attr-defined]
                                self._exchange(grid, version + 1), Tally(self.clock()))
            return version >= self.settings.rounds or self._reached_target(result) or self._stop_requested(result)

        loop.run(done=lambda: version >= self.settings.rounds, fill=lambda: loop.fill(version, pick, send),
                 receive=receive, wait=lambda: self.wait_for_nodes(grid))  # raises NotEnoughNodesError

    def _evaluators(self, grid: object, version: int) -> list[int]:
        """Asynchronous runs: the devices that evaluate a version (a seeded sample of the connected
        ones; busy ones answer after their training message, as a SuperNode runs one at a time)."""
        if self.ctx.evaluation == "central":
            return []
        return sample_nodes(self.roster.order(grid.get_node_ids()), self.settings.clients_per_round,  # type: ignore[attr-defined]
                            self.settings.seed, step=10**9 + version)

    # -- the step's parts -----------------------------------------------------------------------
    def _open(self, number: int, nodes: list[int], connected: int, exchange: Exchange, tally: Tally) -> StepDriver:
        """The algorithm opens the step, and its driver around it: a layer may run exchanges of its
        own over ``exchange`` when its messages go out, and drop nodes, each recorded as a failure
        that the algorithm hears (it frees the node's slot) before the layers."""
        step = self.algorithm.open_step(number, nodes)
        step.connected, step.exchange = connected, exchange

        def heard(failure: Failure) -> None:
            if failure.node is not None:
                self.algorithm.missed(step, failure.node, failure.reason)

        return StepDriver(self.layers, step, tally, heard=heard)

    def _send(self, driver: StepDriver, nodes: list[int]) -> list[Outgoing]:
        """The algorithm's messages for ``nodes``, through every layer (which may keep some back:
        secure aggregation's, to the devices that dealt no shares); those that go out are counted."""
        outgoing = self.algorithm.configure(driver.step, nodes) if nodes else []
        driver.send(outgoing)
        return outgoing

    def _exchange(self, grid: object, number: int) -> Exchange:
        """Send ``outgoing`` and yield each reply (or :class:`Missing`) as it lands."""
        return grid_exchange(grid, number, ttl=self._ttl, clock=self.clock, sleep=self.sleep)

    @property
    def _ttl(self) -> float:
        """A message's lifetime at the SuperLink: the round's timeout and a minute."""
        return self.settings.round_timeout + 60.0

    def _take(self, driver: StepDriver, item: Message | Missing, started: int | None = None) -> Failure | None:
        """One reply (or a missing one) through the door (:meth:`absorb_reply`), counted; None if it
        was used, else the typed failure the algorithm and every layer heard."""
        return driver.take(item, lambda reply: self.absorb_reply(driver.step, reply), started)

    # -- the run's state ------------------------------------------------------------------------
    def _final_model(self) -> torch.Tensor:
        """What the run delivers: the algorithm's final model, or the model average when the run keeps one."""
        average = self.layers.get("model-average")
        model = self.algorithm.final_model()
        return model if average is None else average.delivered(model)  # type: ignore[attr-defined]

    def _write(self, row: RoundRow, result: EngineResult | None) -> None:
        """One row to the metrics log, then an atomic checkpoint (in that order: after a crash in
        between, the step runs again and its row is replaced)."""
        row.wall_seconds = self._wall + self.clock()
        self.run_dir.metrics.append(row.to_json())
        state = {**self.algorithm.state_dict(), **self.layers.state_dict()}
        self.run_dir.checkpoints.save(Checkpoint(round=row.round, algorithm=self.algorithm.spec,
                                                 task=self.ctx.task.spec, numel=self.ctx.numel, state=state))
        if result is not None:
            result.rows.append(row)
        if self.on_row:
            self.on_row(row)

    def _stop_requested(self, result: EngineResult) -> bool:
        """Between steps, after the checkpoint: has the operator asked the run to stop? (``fedge
        serve`` does on SIGTERM, so the daemon stops at a round boundary and a restart resumes.)"""
        if result.rows and result.rows[-1].round < self.settings.rounds and self.run_dir.stop_requested():
            log.info("stop requested: ending after step %d (checkpointed; a restart resumes)", result.rows[-1].round)
            result.stopped = True
        return result.stopped

    def _reached_target(self, result: EngineResult) -> bool:
        """Has the last published row passed ``stop-at`` (or ``stop-accuracy``)? Then the run is
        complete: the model is final, and a restarted coordinator does not train it further."""
        rule = self.settings.stop_rule
        if rule is None or not result.rows:
            return result.reached_target
        name, direction, threshold = rule
        value = result.rows[-1].metrics.get(name, math.nan)
        if value == value and (value >= threshold if direction == ">=" else value <= threshold):
            if not result.reached_target:
                log.info("step %d reached stop-at %s%s%g (%s %s %.4f): the run is complete",
                         result.rows[-1].round, name, direction, threshold, result.rows[-1].evaluation, name, value)
            result.reached_target = True
        return result.reached_target

    def _restore(self, initial_params: torch.Tensor) -> int:
        checkpoint = self.run_dir.checkpoints.load()
        if checkpoint is None:
            self.run_dir.metrics.truncate_after(0)
            self.algorithm.start(initial_params.clone())
            return 0
        where = self.run_dir.path
        if checkpoint.task != self.ctx.task.spec or checkpoint.numel != self.ctx.numel:
            raise IncompatibleCheckpointError(
                f"checkpoint in {where} belongs to task {checkpoint.task!r} ({checkpoint.numel} parameters), "
                f"not {self.ctx.task.spec!r} ({self.ctx.numel})"
            )
        if checkpoint.algorithm != self.algorithm.spec:
            raise IncompatibleCheckpointError(
                f"checkpoint in {where} was written by algorithm {checkpoint.algorithm!r}, this run is "
                f"{self.algorithm.spec!r}; use a new run directory"
            )
        try:
            self.layers.load_state_dict(checkpoint.state)
            self.algorithm.load_state_dict(checkpoint.state)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint in {where} does not fit {self.algorithm.spec}: {err}") from None
        self.run_dir.metrics.truncate_after(checkpoint.round)
        log.info("resuming from checkpoint after round %d", checkpoint.round)
        return checkpoint.round

    def wait_for_nodes(self, grid: object) -> list[int]:
        """The connected nodes, once the algorithm's are there or ``wait-for-nodes`` has passed;
        ``NotEnoughNodesError`` when fewer than ``min-replies`` came."""
        wanted = self.algorithm.nodes_needed()
        deadline = self.clock() + self.settings.wait_for_nodes
        while True:
            nodes = sorted(grid.get_node_ids())  # type: ignore[attr-defined]
            if len(nodes) >= wanted or self.clock() >= deadline:
                break
            if self.run_dir.stop_requested():
                raise _StopWhileWaiting
            self.sleep(1.0)
        if len(nodes) < self.settings.min_replies:
            raise NotEnoughNodesError(
                f"only {len(nodes)} node(s) connected after {self.settings.wait_for_nodes:.0f} s; "
                f"min-replies is {self.settings.min_replies}"
            )
        if self.algorithm.fixed_membership and len(nodes) < wanted:
            raise NotEnoughNodesError(
                f"only {len(nodes)} node(s) connected after {self.settings.wait_for_nodes:.0f} s; "
                f"{self.algorithm.name} runs over a fixed set of {wanted} nodes"
            )
        return nodes

class _StopWhileWaiting(Exception):
    """The operator asked the run to stop before enough nodes had connected."""
