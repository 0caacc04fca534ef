"""``FedBuff`` and ``FedAsync`` for a user's own ServerApp (docs/flower.md, "Asynchronous").

Only the driving is written here: the schedule is the engine's (``fedge.coordinator.async_loop``), so
are the staleness rule and FedAsync's mix (``fedge.aggregation.staleness``), the buffer's rule
(``fedge.aggregation.robust``), the layers, the reply's reading and the door (``fedge.protocol``).
A message sent at version v names round v + 1, as the engine's do, so a device encodes the same
payload for either coordinator. A layer that releases a whole round's aggregate is refused.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedge.aggregation.robust import Aggregator, make_aggregator
from fedge.aggregation.staleness import Staleness, VersionBuffer
from fedge.compression import Codec, make_codec
from fedge.coordinator.app_reply import reply_through_layers, with_extra, with_raw
from fedge.coordinator.driver import StepDriver
from fedge.coordinator.async_loop import AsyncLoop
from fedge.coordinator.step import Missing
from fedge.coordinator.downlink_layer import DownlinkLayer, uplink_codec
from fedge.protocol.failures import FailureKind, Rejected
from fedge.coordinator.layer import Layer, LayerStack, releases_aggregate
from fedge.protocol.layout import Layout
from fedge.protocol.records import MODEL_RECORD, RAW_RECORD
from fedge.coordinator.step import Outgoing, Reply, Step, StepOutcome, Update
from fedge.coordinator.tally import Tally
from fedge.protocol.uplink_request import UplinkRequest

__all__ = ["FedAsync", "FedBuff"]

log = logging.getLogger(__name__)

_NODE_WAIT = 1.0  # seconds between looks for a connected node when none is busy


@dataclass
class _Buffer:
    """One version's buffer: the rule's accumulator, the records of its metrics (its staleness is
    the run's :class:`VersionBuffer`'s)."""

    mean: Aggregator
    driver: StepDriver  # the version being built, as the layers see it, and its accounting
    contents: list[RecordDict] = field(default_factory=list)
    raw: ArrayRecord | None = None  # the integer buffers the latest reply sent


@dataclass
class _Run:
    """What one run's replies are read against: the model's layout, the uplink codec, the nodes'
    copies (the downlink) and every layer, and the versions (the model each one in flight started from)."""

    layout: Layout
    codec: Codec | None
    downlink: DownlinkLayer
    layers: LayerStack
    versions: VersionBuffer


class FedBuff:
    """Buffered asynchronous aggregation (Nguyen et al., AISTATS 2022); see the module docstring."""

    def __init__(self, concurrency: int = 8, buffer: int = 4, uplink: str | None = "qsgd:bits=4",
                 staleness: Staleness | None = None, server_lr: float = 1.0,
                 weighted_by_key: str = "num-examples", seed: int = 0, reply_timeout: float = 600.0,
                 downlink: str = "none", start: str | None = None, aggregator: str = "mean",
                 layers: Iterable[Layer] = ()) -> None:
        if concurrency < 1 or buffer < 1:
            raise ValueError(f"concurrency and buffer must be >= 1, got {concurrency}, {buffer}")
        own = DownlinkLayer.for_app(downlink, start=start)  # an unknown downlink or rule is refused here
        if uplink is not None:
            uplink_codec(uplink, own)
        layers = list(layers)
        for layer in layers:  # what releases a whole round's aggregate cannot run as updates land
            if releases_aggregate(layer):
                raise ValueError(f"layer {layer.key} releases a whole round's aggregate; {type(self).__name__} "
                                 "aggregates each update as it lands")
        LayerStack([own, *layers])  # layers that cannot run together are refused here, not mid-run
        self.layers = layers
        make_aggregator(aggregator, 1, capacity=buffer)
        if not (server_lr > 0 and reply_timeout > 0):
            raise ValueError("server_lr and reply_timeout must be positive")
        self.concurrency, self.buffer, self.uplink = int(concurrency), int(buffer), uplink
        self.staleness = staleness or Staleness()
        self.server_lr, self.weighted_by_key, self.seed = float(server_lr), weighted_by_key, int(seed)
        self.reply_timeout, self.aggregator = float(reply_timeout), aggregator
        self.downlink_spec, self.start_spec = downlink, start
        self.downlink_bytes = 0  # model records sent (fp32 arrays, or lattice, base and raw arrays)
        self.refused: list[tuple[int, int, str]] = []  # (version, node, reason)
        self.dropped_stale = 0
        self.uplink_bytes = 0
        #: called with (version, its train metrics) as each version is published
        self.on_version: Callable[[int, MetricRecord], None] | None = None

    def summary(self) -> None:
        log.info("\t├── %s: concurrency %d, buffer %d, uplink %s, downlink %s, %s, server lr %g",
                 type(self).__name__, self.concurrency, self.buffer, self.uplink or "fp32", self.downlink_spec,
                 self.staleness.spec, self.server_lr)

    # -- the run --------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_versions: int,
              train_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              timeout: float = 3600.0, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> Result:
        """Publish ``num_versions`` versions; Flower's :class:`Result`, indexed by version. Messages
        go out and replies come back on the engine's schedule (:class:`AsyncLoop`: a reply the moment
        it is pulled; a :class:`Missing` at its node's ``reply_timeout``)."""
        layout = Layout(initial_arrays)
        codec = None if self.uplink is None else make_codec(self.uplink).for_model(layout.sizes())  # once per run
        model, like = layout.flatten(initial_arrays).astype(np.float32), initial_arrays
        downlink = DownlinkLayer.for_app(self.downlink_spec, start=self.start_spec,  # the nodes' copies
                                         track_supports=codec is not None and codec.shares_support)
        run = _Run(layout, codec, downlink, LayerStack([downlink, *self.layers]), VersionBuffer(self.staleness,
                                                                                             self._alpha()))
        result = Result(arrays=initial_arrays)
        if evaluate_fn is not None:
            self._evaluate(evaluate_fn, 0, initial_arrays, result)
        rng = random.Random(self.seed)
        loop = AsyncLoop(grid, self.concurrency, self.reply_timeout, clock=clock, sleep=sleep)
        version, buffer, deadline = 0, self._new_buffer(run, 1, clock), clock() + timeout
        log.info("[FedBuff] %d versions, %d nodes in flight, buffer %d", num_versions, self.concurrency, self.buffer)

        def in_time() -> None:
            if clock() > deadline:
                raise TimeoutError(f"FedBuff: {version} of {num_versions} versions within {timeout:g} s")

        def pick(free: list[int], wanted: int, dispatch: int) -> list[int]:
            chosen = run.layers.select(free, wanted, dispatch + 1)  # a layer that chooses (Oort's rule)
            if chosen is not None:
                return chosen
            rng.shuffle(free)  # else a seeded shuffle
            return free[:wanted]

        def send(nodes: list[int]) -> list[Outgoing]:
            arrays = result.arrays  # the current version, built once when it was published
            params = torch.from_numpy(layout.flatten(arrays).copy())
            outgoing = [Outgoing(n, self._content(arrays, layout, version, train_config), MessageType.TRAIN,
                                 model=params) for n in nodes]
            buffer.driver.send(outgoing)  # a layer may keep some back
            b = downlink.broadcast  # with a lattice, nodes train from the public copy
            run.versions.sent([o.node for o in outgoing], torch.from_numpy(model) if b is None
                              else b.public.clone())
            self.downlink_bytes, downlink.bytes = self.downlink_bytes + downlink.bytes, 0
            return outgoing

        def receive(node: int, started: int | None, item: Message | Missing) -> bool:
            nonlocal version, model, like, buffer
            in_time()
            started = version if started is None else started
            failure = buffer.driver.take(item, lambda reply: self._absorb(item, reply, buffer, run), started=started)
            if failure is not None:  # every layer heard it; the versions forget the node's slot
                run.versions.missed(node)
                if failure.kind is FailureKind.STALE:
                    self.dropped_stale += 1
                else:  # a node that did not answer is counted at the version it was waited for
                    at = version if failure.kind is FailureKind.TIMEOUT else started
                    self.refused.append((at, node, failure.reason))
            if buffer.mean.count < self.buffer:
                return False
            model = self._advance(model, buffer, run.versions)
            version += 1
            like = like if buffer.raw is None else with_raw(like, buffer.raw)  # integer buffers: the latest sent
            result.arrays = layout.rebuild(model, like)
            outcome = StepOutcome(model=torch.from_numpy(model.copy()))
            buffer.driver.close(outcome)
            self.uplink_bytes += buffer.driver.tally.uplink  # the version's replies and its layers' exchanges
            result.train_metrics_clientapp[version] = with_extra(self._train_metrics(buffer, run.versions),
                                                                 {**outcome.extra, **buffer.driver.tally.app_metrics()})
            if self.on_version is not None:  # fedge.flower.tracked: the version's figures as they are known
                self.on_version(version, result.train_metrics_clientapp[version])
            log.info("[FedBuff] version %d: %d updates, staleness mean %.2f", version, buffer.mean.count,
                     run.versions.publish(version)["staleness_mean"])
            if evaluate_fn is not None:
                self._evaluate(evaluate_fn, version, result.arrays, result)
            buffer = self._new_buffer(run, version + 1, clock)
            return version >= num_versions

        def done() -> bool:
            in_time()
            return version >= num_versions

        loop.run(done=done, fill=lambda: loop.fill(version, pick, send), receive=receive,
                 wait=lambda: sleep(_NODE_WAIT))  # no node connected yet: wait for one, as the engine does
        return result

    def _new_buffer(self, run: _Run, number: int, clock: Callable[[], float]) -> _Buffer:
        """The buffer of version ``number`` (the step the layers see builds it from the one before)."""
        return _Buffer(make_aggregator(self.aggregator, run.layout.numel, capacity=self.buffer),
                       StepDriver(run.layers, Step(number), Tally(clock()), app=True))

    def _alpha(self) -> float | None:
        return None  # FedBuff: a buffer of updates per version

    def _advance(self, model: np.ndarray, buffer: _Buffer, versions: VersionBuffer) -> np.ndarray:
        """The next version: the buffer's mean moves the model by ``server_lr`` (FedBuff)."""
        return (model + self.server_lr * buffer.mean.result().numpy()).astype(np.float32)

    def _absorb(self, message: Message, reply: Reply, buffer: _Buffer, run: _Run) -> Update:
        """One reply into the buffer (``fedge.coordinator.app_reply``), as the engine takes it: refused
        when staler than the bound before it is decoded, decoded with its round's codec (``tcs``: on
        its node's support), added with weight w·s(τ). Raises what refuses it."""
        assert reply.started is not None
        started = reply.started

        def admit() -> None:
            if run.versions.admit(reply.node, started) is None:
                raise Rejected(f"stale by {run.versions.version - started} versions", kind=FailureKind.STALE)

        base = run.versions.models.get(started)
        if base is None:  # a version is forgotten once a reply to it would be too stale
            admit()
            raise Rejected(f"reply to version {started}, which this coordinator never sent")
        wire = None if run.codec is None else run.downlink.bind(run.codec.for_round(started + 1, self.seed),
                                                                reply.node)
        update, _ = reply_through_layers(run.layers, buffer.driver.step, message, reply, run.layout, wire,
                                         base.numpy(), self.weighted_by_key, admit)
        assert update is not None  # no layer takes a reply whole here (SUM layers are refused)
        run.versions.add(buffer.mean, update.vector, update.weight, started)
        buffer.contents.append(RecordDict({"metrics": next(iter(message.content.metric_records.values()))}))
        buffer.raw = message.content.array_records.get(RAW_RECORD, buffer.raw)
        return update

    # -- pieces ---------------------------------------------------------------------------------
    def _content(self, arrays: ArrayRecord, layout: Layout, version: int,
                 train_config: ConfigRecord | None) -> RecordDict:
        config = ConfigRecord(dict(train_config or {}))
        # what Flower's strategies put in every train message (a ClientApp written for them reads
        # it): the round this message's update is for, version + 1, as the engine names it
        config.setdefault("server-round", version + 1)
        if self.uplink is not None:
            UplinkRequest(self.uplink, layout.digest, version + 1, self.seed).write(config)
        return RecordDict({MODEL_RECORD: arrays, "config": config})

    def _train_metrics(self, buffer: _Buffer, versions: VersionBuffer) -> MetricRecord:
        """The replies' metrics averaged as Flower's FedAvg averages them (weighted by
        ``weighted_by_key``), the staleness, and Fedge's counters."""
        out = aggregate_metricrecords(buffer.contents, self.weighted_by_key)
        out["staleness-mean"] = float(versions.tally.report()["staleness_mean"])
        out["fedge-uplink-bytes"] = float(self.uplink_bytes)
        out["fedge-downlink-bytes"] = float(self.downlink_bytes)
        out["fedge-dropped-stale"] = float(self.dropped_stale)
        return out

    @staticmethod
    def _evaluate(evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None], version: int,
                  arrays: ArrayRecord, result: Result) -> None:
        metrics = evaluate_fn(version, arrays)
        if metrics is not None:
            result.evaluate_metrics_serverapp[version] = metrics
            log.info("[FedBuff] version %d: %s", version, dict(metrics))


class FedAsync(FedBuff):
    """Every update is a version: the client's model mixed in at ``alpha`` × s(τ) (Xie, Koyejo and
    Gupta 2019), by the engine's rule (:func:`fedge.aggregation.staleness.fedasync_mix`)."""

    def __init__(self, concurrency: int = 8, alpha: float = 0.6, **kwargs: object) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        super().__init__(concurrency=concurrency, buffer=1, **kwargs)  # type: ignore[arg-type]

    def _alpha(self) -> float | None:
        return self.alpha

    def _advance(self, model: np.ndarray, buffer: _Buffer, versions: VersionBuffer) -> np.ndarray:
        return versions.mixed(torch.from_numpy(model))[0].numpy().astype(np.float32)
