"""The round engine: the lifecycle every algorithm shares, over Flower's ``Grid``.

Per run: resume from the run directory's checkpoint (or start the algorithm fresh), wait for nodes,
then per step: select nodes (a seeded sample by default), push the algorithm's messages, feed each
reply to the algorithm the moment it is pulled (validation failures, client errors and timeouts
become rejected entries with their reason), close the step, evaluate the step's model on held-out
data, run the optional evaluation exchange, then write one metrics row and an atomic checkpoint,
in that order (after a crash in between, the step runs again and its row is replaced).

Every reply passes one door, :meth:`Engine.absorb_reply`, whatever the algorithm: screened
(``reply_screen``), admitted by the algorithm, decoded with the codec of its round, bounded by the
run's update guard (norm bound, example-count cap), and only then handed to the algorithm. The
synchronous and the asynchronous loop share the reply accounting (:class:`_Tally`) and the metrics
row built from it: ``uplink_bytes`` are the bytes of the ``update`` record of used replies (the real
encoded payloads, headers included), ``measurement_bytes`` those of ``measure`` records,
``downlink_bytes`` every array sent.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from fedge.aggregation.model_average import ModelAverage, parse_model_average
from fedge.compression import PayloadError, derive_seed
from fedge.deploy.atomic import atomic_write_text
from fedge.protocol import CONFIG_RECORD, MEASURE_RECORD, METRICS_RECORD, UPDATE_RECORD, ProtocolError, array_bytes, read_payload
from fedge.server.engine.algorithm import (
    Algorithm,
    Outgoing,
    Rejected,
    Reply,
    RunContext,
    Step,
    StepOutcome,
    Update,
    reply_metrics,
)
from fedge.server.run.checkpoint import Checkpoint, CheckpointError, IncompatibleCheckpointError
from fedge.server.engine.dispatcher import Dispatcher, Missing
from fedge.server.engine.central_dp import central_dp_of
from fedge.server.engine.secure_round import SecureRound, refuse_reason, run_id_for
from fedge.privacy.errors import SecAggError
from fedge.privacy.spec import SecAggSpec, parse_secure_aggregation
from fedge.protocol.secagg import SECAGG_RECORD
from fedge.server.run.metrics_row import RoundRow
from fedge.server.engine.reply_screen import screen_reply
from fedge.server.engine.evaluation import FederatedEvaluation, evaluation_mode
from fedge.server.engine.update_guard import UpdateGuard
from fedge.server.run.run_directory import RunDirectory
from fedge.server.settings import RunSettings, SettingsError
from fedge.tasks import Task, evaluate, numel_of, unflatten_state
from fedge.tasks.data_files import load_npz

__all__ = ["Engine", "EngineResult", "NotEnoughNodesError", "make_context", "model_average_of", "sample_nodes"]

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
    uninterrupted one. Node ids are unsigned 64-bit: pick positions, never pass ids through numpy."""
    nodes = sorted(nodes)
    count = min(count, len(nodes))
    rng = np.random.default_rng(derive_seed(seed, step, purpose="sample"))
    return sorted(nodes[int(i)] for i in rng.choice(len(nodes), size=count, replace=False))


def secure_aggregation_of(algorithm: Algorithm) -> SecAggSpec | None:
    """The run's secure-aggregation spec, or None; a combination that cannot work is refused here
    (the CLI's preflight calls this before any process starts)."""
    settings = algorithm.ctx.settings
    try:
        spec = parse_secure_aggregation(settings.secure_aggregation)
    except ValueError as err:
        raise SettingsError(f"secure-aggregation: {err}") from None
    if spec is None:
        return None
    reason = refuse_reason(algorithm)
    if reason is None and settings.aggregator != "mean":
        reason = f"aggregator {settings.aggregator!r} works on individual updates; secure aggregation only reveals their sum"
    if reason is None and settings.update_norm != "none":
        reason = ("update-norm bounds each decoded update, which the coordinator never sees under secure "
                  "aggregation; the shared grid's clip bounds every coordinate instead")
    if reason is not None:
        raise SettingsError(f"secure-aggregation cannot run with algorithm {algorithm.spec!r}: {reason}")
    return spec


def model_average_of(algorithm: Algorithm) -> ModelAverage | None:
    """The run's ``model-average`` (None for 'none'); a bad spec is refused here (the CLI's preflight
    calls this before any process starts). Which algorithms may set it, the registry checks."""
    try:
        return parse_model_average(algorithm.ctx.settings.model_average)
    except ValueError as err:
        raise SettingsError(str(err)) from None


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
        self._model = self.ctx.task.build_model()
        #: norm bound and weight cap of every decoded update, for every algorithm (checkpointed)
        self.guard = UpdateGuard(self.settings)
        #: secure aggregation (``secure-aggregation``): the spec, and each node's identity key,
        #: pinned the first time it takes part
        self.secure = secure_aggregation_of(algorithm)
        self._pins: dict[int, bytes] = {}
        #: client-level differential privacy (``differential-privacy``): sampling, clipping, noise, ledger
        self.dp = central_dp_of(algorithm)
        #: ``model-average``: the delivered (evaluated, saved, exported) model averages the published ones
        self.average = model_average_of(algorithm)

    # -- public ---------------------------------------------------------------------------------
    def run(self, grid: object, initial_params: torch.Tensor) -> EngineResult:
        start = self._restore(initial_params)
        rows = [RoundRow.from_json(r) for r in self.run_dir.metrics.read()]
        # wall_seconds counts this run's time, across restarts (a restart's downtime is not counted)
        self._wall = (rows[-1].wall_seconds if rows else 0.0) - self.clock()
        result = EngineResult(model=self._final_model(), rows=rows, resumed_from=start)
        described = {**self.algorithm.describe(), "update_norm": self.guard.norm.spec, "weight_cap": self.guard.cap.spec}
        atomic_write_text(self.run_dir.path / "algorithm.json", json.dumps(described, indent=2) + "\n")
        if start >= self.settings.rounds or self._reached_target(result):
            log.info("run already complete (%d rounds)", start)
            return result
        try:
            nodes = self._wait_for_nodes(grid)
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
                if self.dp is not None and self.dp.exhausted(len(grid.get_node_ids()), self.settings.clients_per_round):  # type: ignore[attr-defined]
                    log.info("privacy budget: one more round would spend more than epsilon=%g (delta=%g); run complete "
                             "after round %d", self.dp.spec.budget, self.dp.spec.delta, step - 1)
                    result.budget_spent = True
                    break
                self._publish(self.step(grid, step), result)
                if self._reached_target(result) or self._stop_requested(result):
                    break
        result.model = self._final_model()
        return result

    def _final_model(self) -> torch.Tensor:
        """What the run delivers: the algorithm's final model, or its average (``model-average``)."""
        averaged = self.average.value() if self.average is not None else None
        return averaged if averaged is not None else self.algorithm.final_model()

    def _close(self, step: Step) -> StepOutcome:
        """Close a step; with ``model-average`` the outcome's model (what is measured) is the average
        of the published models, and the algorithm's own model keeps training."""
        outcome = self.algorithm.close(step)
        if self.average is not None and outcome.model is not None:
            outcome.model = self.average.update(outcome.model)
            outcome.extra["model_average"] = self.average.spec
        return outcome

    def _publish(self, row: RoundRow, result: EngineResult) -> None:
        """One row to the metrics log, then an atomic checkpoint (in that order: after a crash in
        between, the step runs again and its row is replaced)."""
        row.wall_seconds = self._wall + self.clock()
        self.run_dir.metrics.append(row.to_json())
        state = {**self.algorithm.state_dict(), "guard": self.guard.state_dict()}
        if self.dp is not None:
            state["dp"] = self.dp.state_dict()
        if self.average is not None:
            state["model-average"] = self.average.state_dict()
        self.run_dir.checkpoints.save(Checkpoint(round=row.round, algorithm=self.algorithm.spec,
                                                 task=self.ctx.task.spec, numel=self.ctx.numel, state=state))
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

    def evaluate(self, params: torch.Tensor) -> dict[str, float]:
        """Loss and the task's metrics of a flat model on the coordinator's held-out data (empty
        when the run has none: it evaluates on the devices)."""
        if self.ctx.central_data is None:
            return {}
        self._model.load_state_dict(unflatten_state(params, self.ctx.template))
        return evaluate(self._model, self.ctx.central_data, self.ctx.task)

    def measure(self, grid: object, number: int, model: torch.Tensor | None, nodes: list[int],
                tally: _Tally) -> tuple[dict[str, float], dict[str, object]]:
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
        for item in Dispatcher(grid, clock=self.clock, sleep=self.sleep).exchange(
                self._messages(outgoing, number, "eval"), self.settings.round_timeout):
            if isinstance(item, Missing):
                federated.ignore(item.node, item.reason)
            elif item.has_error():
                federated.ignore(item.metadata.src_node_id, f"client error {item.error.code}: {item.error.reason}")
            else:
                try:
                    federated.absorb(item.metadata.src_node_id, item.content)
                except Rejected as err:
                    federated.ignore(item.metadata.src_node_id, str(err))
        if mode == "federated":
            return federated.result(), federated.facts()
        return central, {**{f"federated_{k}": v for k, v in federated.result().items()}, **federated.facts()}

    def sample(self, nodes: list[int], step: int) -> list[int]:
        if self.dp is not None:  # Poisson sampling from the OS CSPRNG: what the accountant assumes
            return self.dp.sample(nodes, self.settings.clients_per_round)
        return sample_nodes(nodes, self.settings.clients_per_round, self.settings.seed, step)

    def step(self, grid: object, step: int) -> RoundRow:
        """One synchronous step: select, send, absorb every reply as it lands, close, evaluate."""
        if self.secure is not None:
            return self._secure_step(grid, step)
        alg = self.algorithm
        tally = _Tally(self.clock())
        nodes = sorted(grid.get_node_ids())  # type: ignore[attr-defined]
        selected = alg.select(step, nodes, self.sample)
        state = alg.open_step(step, selected)
        outgoing = alg.configure(state, selected)
        tally.sent(outgoing)
        exchange = Dispatcher(grid, clock=self.clock, sleep=self.sleep).exchange(
            self._messages(outgoing, step, "train"), self.settings.round_timeout)
        for item in exchange:
            self._receive(state, item, tally)
        if self.dp is not None:
            dp, connected = self.dp, len(nodes)
            state.finish = lambda mean, used: dp.noisy_mean(mean * used, connected)
        outcome = self._close(state)
        if self.dp is not None:
            outcome.extra.update(self.dp.close_round())
        metrics, extra = self.measure(grid, step, outcome.model, selected, tally)
        return self._row(step, tally, outcome, metrics, extra)

    def _secure_step(self, grid: object, step: int) -> RoundRow:
        """A synchronous step under secure aggregation (``secure_round``): advertise, share, train
        (masked uploads), unmask; the algorithm gets only the weighted mean of the survivors."""
        assert self.secure is not None
        alg = self.algorithm
        tally = _Tally(self.clock())
        nodes = sorted(grid.get_node_ids())  # type: ignore[attr-defined]
        selected = alg.select(step, nodes, self.sample)
        state = alg.open_step(step, selected)
        secure = SecureRound(self.secure, run_id_for(self.settings.seed, self.run_dir.path.name), self.settings.seed,
                             step, selected, self.ctx.numel, self._pins, weighted=alg.weighted)

        def exchange(outgoing: list[Outgoing], timeout: float, group: str):  # type: ignore[no-untyped-def]
            return Dispatcher(grid, clock=self.clock, sleep=self.sleep).exchange(
                self._messages(outgoing, step, group), timeout)

        notes: list[dict[str, object]] = []
        try:
            secure.advertise(exchange)
            dealt = secure.share(exchange)
            outgoing = alg.configure(state, dealt)
            for o in outgoing:
                o.content[SECAGG_RECORD] = secure.train_record(o.node)
            tally.sent(outgoing)
            tally.sampled = len(selected)  # those that missed a key stage were sampled too
            replies: dict[int, object] = {}
            for item in exchange(outgoing, self.settings.round_timeout, "train"):
                if isinstance(item, Missing):
                    secure.missing[item.node] = item.reason
                elif item.has_error():
                    secure.missing[item.metadata.src_node_id] = f"client error {item.error.code}: {item.error.reason}"
                else:
                    replies[item.metadata.src_node_id] = item.content
                    tally.uplink += array_bytes(item.content, (UPDATE_RECORD,))
                    tally.train_seconds.append(_train_seconds(item))
            survivors = secure.masked_inputs(replies)  # type: ignore[arg-type]
            mean, count, _ = secure.unmask(exchange, survivors)
            alg.absorb_secure(state, mean, survivors)
            tally.used = count
        except SecAggError as error:  # the sum cannot be unmasked: the round changes nothing
            log.error("round %d: secure aggregation failed: %s; global model unchanged", step, error)
            notes.append({"node": None, "reason": f"secure aggregation failed: {error}"})
        for node, reason in sorted(secure.missing.items()):
            tally.rejected.append({"node": node, "reason": reason})
            alg.missed(state, node, reason)
        tally.uplink += secure.uplink
        tally.downlink += secure.downlink
        outcome = self._close(state)
        outcome.notes.extend(notes)
        outcome.extra.update({"secure_aggregation": self.secure.spec,
                              "secagg_ring_bits": secure.plan.bits, "secagg_neighbours": secure.plan.degree})
        metrics, extra = self.measure(grid, step, outcome.model, selected, tally)
        return self._row(step, tally, outcome, metrics, extra)

    def _run_async(self, grid: object, start: int, result: EngineResult) -> None:
        """Asynchronous steps: keep ``concurrency`` clients busy; whenever a reply lands, hand it to
        the algorithm and send that node's slot to a free node; close a step (a new model version)
        whenever the algorithm is ready. Messages still out when the last version is published are
        abandoned: their updates would train a finished model."""
        alg = self.algorithm
        dispatcher = Dispatcher(grid, clock=self.clock, sleep=self.sleep)
        busy: dict[int, int] = {}  # node -> the version its message started from
        free_since: dict[int, float] = {}  # node -> when its last reply landed
        version, dispatches = start, 0
        state, tally = alg.open_step(version + 1, []), _Tally(self.clock())

        def fill() -> None:
            nonlocal dispatches
            free = [n for n in sorted(grid.get_node_ids()) if n not in busy]  # type: ignore[attr-defined]
            want = min(alg.concurrency - len(busy), len(free))
            if want <= 0:
                return
            # Seeded by a dispatch counter: which free nodes get the slots is reproducible for a
            # given order of replies (the order itself follows the devices' real speed).
            picked = sample_nodes(free, want, self.settings.seed, step=10**6 * (version + 1) + dispatches)
            dispatches += 1
            outgoing = alg.configure(state, picked)
            tally.sent(outgoing)
            dispatcher.push(self._messages(outgoing, version + 1, f"v{version}-d{dispatches}"),
                            self.settings.round_timeout)
            for o in outgoing:
                busy[o.node] = version
                tally.idle += max(0.0, self.clock() - free_since.pop(o.node, self.clock()))

        while version < self.settings.rounds:
            fill()
            if not busy:
                self._wait_for_nodes(grid)  # raises NotEnoughNodesError after wait-for-nodes
                continue
            for item in dispatcher.replies():
                node = item.node if isinstance(item, Missing) else item.metadata.src_node_id
                began = busy.pop(node, None)
                free_since[node] = self.clock()
                self._receive(state, item, tally, started=began)
                if alg.ready(state):
                    version += 1
                    outcome = self._close(state)
                    metrics, extra = self.measure(grid, version, outcome.model, self._evaluators(grid, version), tally)
                    self._publish(self._row(version, tally, outcome, metrics, {"client_idle_seconds": tally.idle, **extra}),
                                  result)
                    state, tally = alg.open_step(version + 1, []), _Tally(self.clock())
                    if version >= self.settings.rounds or self._reached_target(result) or self._stop_requested(result):
                        return
                if not dispatcher.batch_left:
                    fill()

    def absorb_reply(self, step: Step, reply: Reply) -> None:
        """The one door of every update: screen the reply, let the algorithm admit it, decode it with
        the codec of its round (validated in full before anything moves), bound it, weight it, and
        hand it to the algorithm. Raises :class:`Rejected`, ``PayloadError`` or ``ProtocolError``."""
        alg = self.algorithm
        screen_reply(reply.content, self.ctx.fp32_bytes)
        alg.admit(step, reply)
        payload = read_payload(reply.content, UPDATE_RECORD)
        metrics = reply_metrics(reply.content)
        vector = alg.reply_codec(step, reply).decode(payload, self.ctx.numel)
        vector = self.guard.bound(step.number, reply.node, vector)
        weight = self.guard.weight(step.number, reply.node, float(metrics["num-examples"])) if alg.weighted else 1.0
        if self.dp is not None:  # the sensitivity bound holds whatever the device sent; every device counts once
            vector, weight = self.dp.clip(vector, metrics.get("dp-fitted")), 1.0
        alg.absorb(step, Update(node=reply.node, vector=vector, weight=weight, metrics=metrics, payload=bytes(payload),
                                content=reply.content, started=reply.started))

    def _evaluators(self, grid: object, version: int) -> list[int]:
        """Asynchronous runs: the devices that evaluate a version (a seeded sample of the connected
        ones; busy ones answer after their training message, as a SuperNode runs one at a time)."""
        if self.ctx.evaluation == "central":
            return []
        return sample_nodes(sorted(grid.get_node_ids()), self.settings.clients_per_round,  # type: ignore[attr-defined]
                            self.settings.seed, step=10**9 + version)

    def _row(self, number: int, tally: _Tally, outcome: StepOutcome, metrics: dict[str, float],
             extra: dict[str, object]) -> RoundRow:
        """The metrics row of a step, synchronous or asynchronous alike."""
        extra = {**outcome.extra, **self.guard.close_step(), **extra}
        if tally.train_seconds:
            extra["client_train_seconds"] = max(tally.train_seconds)
        row = RoundRow(
            round=number, algorithm=self.algorithm.name, metrics=metrics, metric=self.ctx.task.primary_metric,
            evaluation="federated" if self.ctx.evaluation == "federated" else "central",
            train_loss=outcome.train_loss, uplink_bytes=tally.uplink, uplink_fp32_bytes=tally.used * self.ctx.fp32_bytes,
            downlink_bytes=tally.downlink, measurement_bytes=tally.measurement, seconds=self.clock() - tally.began,
            clients_sampled=tally.sampled, clients_used=tally.used, clients_failed=len(tally.rejected),
            codec=self.algorithm.codec.spec, rejected=tally.rejected + outcome.notes, extra=extra,
        )
        log.info("%s %d: %s %s %.4f loss %.4f | %d/%d clients | uplink %d B (fp32 %d B) | %.1f s",
                 "version" if self.algorithm.asynchronous else "round", number, row.evaluation, row.metric,
                 row.score, row.loss, tally.used,
                 tally.sampled, tally.uplink, row.uplink_fp32_bytes, row.seconds)
        return row

    # -- internals ------------------------------------------------------------------------------
    def _receive(self, step: Step, item: Message | Missing, tally: _Tally, started: int | None = None) -> None:
        """Hand one reply (or a missing one) to the algorithm and count it; a reply that cannot be
        used is logged and recorded with its reason, and the algorithm hears that the node missed."""
        node, reason = self._absorb(step, item, started)
        if reason is None:
            assert isinstance(item, Message)
            tally.used += 1
            tally.uplink += array_bytes(item.content, (UPDATE_RECORD,))
            tally.measurement += array_bytes(item.content, (MEASURE_RECORD,))
            tally.train_seconds.append(_train_seconds(item))
        else:
            tally.rejected.append({"node": node, "reason": reason})
            self.algorithm.missed(step, node, reason)

    def _absorb(self, step: Step, item: Message | Missing, started: int | None = None) -> tuple[int, str | None]:
        """Hand one reply to the algorithm; (node, None) if used, else (node, reason)."""
        if isinstance(item, Missing):
            return item.node, item.reason
        node = item.metadata.src_node_id
        if item.has_error():
            return node, f"client error {item.error.code}: {item.error.reason}"
        try:
            self.absorb_reply(step, Reply(node, item.content, started=started))
        except (Rejected, PayloadError, ProtocolError) as err:
            log.warning("round %d: rejected update from node %d: %s", step.number, node, err)
            return node, str(err)
        return node, None

    def _messages(self, outgoing: list[Outgoing], step: int, group: str) -> list[Message]:
        handler = self.algorithm.plugin_handler
        for o in outgoing:  # a plugin algorithm's messages name their device handler
            if handler and CONFIG_RECORD in o.content.config_records:
                o.content.config_records[CONFIG_RECORD]["handler"] = handler
            if self.dp is not None and CONFIG_RECORD in o.content.config_records:  # this round's clipping bound
                o.content.config_records[CONFIG_RECORD]["dp-clip"] = self.dp.clip_bound
        return [
            Message(o.content, dst_node_id=o.node, message_type=o.message_type, group_id=f"{step}-{group}",
                    ttl=self.settings.round_timeout + 60.0)
            for o in outgoing
        ]

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
            self.guard.load_state_dict(checkpoint.state.get("guard") or {})
            if self.dp is not None:
                if "dp" not in checkpoint.state:
                    raise ValueError("the checkpoint has no privacy ledger: it was not a differentially private run")
                self.dp.load_state_dict(checkpoint.state["dp"])
            if self.average is not None:
                if "model-average" not in checkpoint.state:
                    raise ValueError("the checkpoint has no model average: the run did not set model-average")
                self.average.load_state_dict(checkpoint.state["model-average"])
            self.algorithm.load_state_dict(checkpoint.state)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint in {where} does not fit {self.algorithm.spec}: {err}") from None
        self.run_dir.metrics.truncate_after(checkpoint.round)
        log.info("resuming from checkpoint after round %d", checkpoint.round)
        return checkpoint.round

    def _wait_for_nodes(self, grid: object) -> list[int]:
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
        return nodes


class _StopWhileWaiting(Exception):
    """The operator asked the run to stop before enough nodes had connected."""


@dataclass
class _Tally:
    """The reply accounting of one step, for its metrics row: the same for a synchronous round and
    an asynchronous version."""

    began: float
    sampled: int = 0  # messages sent (asynchronous: dispatched while this version was built)
    used: int = 0
    uplink: int = 0
    measurement: int = 0
    downlink: int = 0
    idle: float = 0.0  # asynchronous: node-seconds between a node's reply and its next message
    train_seconds: list[float] = field(default_factory=list)  # clients' own training time
    rejected: list[dict[str, object]] = field(default_factory=list)

    def sent(self, outgoing: list[Outgoing]) -> None:
        self.sampled += len(outgoing)
        self.downlink += sum(array_bytes(o.content) for o in outgoing)


def _train_seconds(reply: Message) -> float:
    """A reply's own ``train-seconds`` (a number >= 0), or 0 when it sent none or nonsense: it is
    reported, never trusted for anything else."""
    metrics = reply.content.metric_records.get(METRICS_RECORD)
    value = metrics.get("train-seconds", 0.0) if metrics is not None else 0.0
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 else 0.0
