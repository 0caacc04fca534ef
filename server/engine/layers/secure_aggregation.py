"""Secure aggregation as a layer (``secure-aggregation = "secagg:..."``): the coordinator learns only
the sum of a round's updates (``fedge.protocol.secure_round`` runs the protocol's stages).

Around the algorithm's own step: before it configures, the layer runs the key agreement
(advertise, share) and narrows the step to the devices that dealt their shares; it staples each
train message with the plan and the shares for that device; each masked reply comes through the
engine's one door like any other (screened, its metrics checked) and the layer takes it whole,
after checking its size against the plan; after the replies it unmasks the survivors' sum and
releases it (``release``) as the step's :class:`~fedge.aggregation.partial.Partial`, in place of
the clear one, which holds nothing. The algorithm declares only that its step works from a mean or
a sum (``Algorithm.aggregate``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from flwr.app import MessageType

from fedge.aggregation.partial import Partial
from fedge.privacy.credentials import CredentialError, load_issuer
from fedge.privacy.distributed_dp import SkellamParams, round_noise
from fedge.privacy.dp_spec import DPSpec, parse_differential_privacy
from fedge.privacy.errors import SecAggError
from fedge.privacy.spec import SecAggSpec, parse_secure_aggregation
from fedge.server.engine.algorithm import Algorithm, Outgoing, Reply, Step, StepOutcome
from fedge.protocol.dispatcher import Missing
from fedge.server.engine.layers.base import MODEL, SUM, Exchange, Failure, Layer
from fedge.protocol.secagg import SECAGG_RECORD
from fedge.protocol.secure_round import SecureRound, StageExchange
from fedge.server.engine.tally import Tally
from fedge.server.settings import SettingsError

__all__ = ["SecureAggregationLayer", "refuse_reason"]

log = logging.getLogger(__name__)

def refuse_reason(algorithm: Algorithm) -> str | None:
    """Why an algorithm cannot run under secure aggregation (None: it can)."""
    name, settings = algorithm.name, algorithm.ctx.settings
    if algorithm.asynchronous:
        return (f"{name} aggregates each update as it lands (asynchronously); secure aggregation only "
                "reveals the sum of a whole round")
    if algorithm.aggregate not in ("mean", "sum"):
        return (f"{name} needs each device's update (gossip relays them, robust rules rank them); secure "
                "aggregation only reveals their sum")
    if not algorithm.device_layers:
        return (f"the devices of {name} run the plugin's own handler, which does not send its update through "
                "Fedge's upload layers, so it would never be masked; register it with a handler built by "
                "fedge.edge_client.layers (see docs/extending.md)")
    if settings.aggregator != "mean":
        return (f"aggregator {settings.aggregator!r} works on individual updates; secure aggregation only "
                "reveals their sum")
    if settings.update_norm != "none":
        return ("update-norm bounds each decoded update, which the coordinator never sees under secure "
                "aggregation; the shared grid's clip bounds every coordinate instead")
    return None


def _stages(exchange: Exchange) -> StageExchange:
    """The protocol's stages over the engine's dispatcher (``train`` messages with the ``secagg``
    record, as in a Flower app: one convention, ``fedge.protocol.secagg``)."""

    def run(asks: list[tuple[int, Any]], timeout: float, label: str):  # type: ignore[no-untyped-def]
        for item in exchange([Outgoing(node, content, MessageType.TRAIN) for node, content in asks], timeout, label):
            yield (item.node, item.reason) if isinstance(item, Missing) else item

    return run


@dataclass
class _Round:
    """One round's protocol state: its stages, the masked uploads taken, what went wrong."""

    secure: SecureRound | None = None
    uploads: dict[int, bytes] = field(default_factory=dict)
    #: the devices planned into the round (under distributed DP each adds 1/planned of the noise)
    planned: int = 0
    #: the survivors' unmasked sum, once stage 4 succeeded
    revealed: Partial | None = None
    notes: list[dict[str, Any]] = field(default_factory=list)


class SecureAggregationLayer(Layer):
    key = "secure-aggregation"
    provides = frozenset({SUM})
    needs = frozenset({MODEL})  # its record rides on the message that carries the model

    def __init__(self, spec: SecAggSpec, algorithm: Algorithm, run_id: bytes, issuer: Any = None,
                 dp_spec: DPSpec | None = None) -> None:
        self.spec = spec
        #: with differential privacy: the devices add Skellam noise inside the ring (distributed DP)
        self.dp_spec = dp_spec
        self.clients_per_round = algorithm.ctx.settings.clients_per_round
        #: the operator CA's key when identities must be issued (``issuer=``); None: trust on first use
        self.issuer = issuer
        self.run_id = run_id
        self.seed = algorithm.ctx.settings.seed
        self.numel = algorithm.ctx.numel
        self.weighted = algorithm.weighted
        #: each node's identity key, pinned the first time it takes part
        self.pins: dict[int, bytes] = {}

    @classmethod
    def build(cls, algorithm: Algorithm, run_dir: Any = None) -> SecureAggregationLayer | None:
        """The run's secure aggregation, or None; a combination that cannot work is refused here
        (the CLI's preflight builds every layer before any process starts)."""
        try:
            spec = parse_secure_aggregation(algorithm.ctx.settings.secure_aggregation)
        except ValueError as err:
            raise SettingsError(f"secure-aggregation: {err}") from None
        if spec is None:
            return None
        reason = refuse_reason(algorithm)
        if reason is not None:
            raise SettingsError(f"secure-aggregation cannot run with algorithm {algorithm.spec!r}: {reason}")
        if algorithm.ctx.settings.clients_per_round < 2:
            raise SettingsError("secure-aggregation needs clients-per-round >= 2: one device's sum is its update")
        dp = parse_differential_privacy(algorithm.ctx.settings.differential_privacy)
        if dp is not None and spec.ratio < 1:
            raise SettingsError("secure-aggregation ratio < 1 (random-k) cannot carry distributed DP: the noise "
                                "and the sensitivity cover the whole update; use ratio=1")
        issuer = None
        if spec.issuer:
            try:
                issuer = load_issuer(spec.issuer)
            except CredentialError as err:
                raise SettingsError(f"secure-aggregation: {err}") from None
        # Random, and kept in the checkpoint: every signature and share of this run is bound to it,
        # and no other run (a rerun with the same seed and directory name included) shares it.
        return cls(spec, algorithm, os.urandom(16), issuer, dp)

    def _noise(self, planned: int) -> SkellamParams | None:
        """Under distributed DP: each of the ``planned`` devices' share of the round's noise."""
        if self.dp_spec is None:
            return None
        return round_noise(self.dp_spec, self.numel, planned)

    def _failures(self, state: _Round) -> list[Failure]:
        """Nodes the protocol dropped since the last report, once each."""
        assert state.secure is not None
        return state.secure.dropped()

    def open(self, step: Step, exchange: Exchange) -> list[Failure]:
        """Stages 1 and 2: advertise, share. Only the devices that dealt their shares train."""
        state: _Round = self.scratch(step, _Round)
        try:
            if self.spec.issuer:  # the operator's revocations as they stand now: a revoked device is out
                self.issuer = load_issuer(self.spec.issuer)  # from this round on, without a restart
            state.secure = SecureRound(self.spec, self.run_id, self.seed, step.number, step.nodes, self.numel,
                                       self.pins, weighted=self.weighted, issuer=self.issuer,
                                       noise=self._noise(len(step.nodes)))
            state.planned = len(step.nodes)
            state.secure.advertise(_stages(exchange))
            step.nodes = state.secure.share(_stages(exchange))
        except SecAggError as error:  # the round cannot go on: nobody trains, the model is unchanged
            self._abandon(step, state, error)
            step.nodes = []
        return self._failures(state) if state.secure is not None else []

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        state: _Round = self.scratch(step, _Round)
        if state.secure is None:  # the round could not be planned: nothing is sent
            return
        for o in outgoing:
            o.content[SECAGG_RECORD] = state.secure.train_record(o.node)

    def arrived(self, step: Step, reply: Reply, payload: memoryview, metrics: dict[str, float]) -> bool:
        """A masked upload, already screened with its metrics checked: its size must be exactly what
        the plan expects before it is held (its header and ring elements are decoded once, when the
        round unmasks; a bad one drops its device there)."""
        state: _Round = self.scratch(step, _Round)
        assert state.secure is not None
        state.uploads[reply.node] = state.secure.check_upload(metrics, payload)
        return True

    def settle(self, step: Step, exchange: Exchange, tally: Tally) -> list[Failure]:
        """Stage 4: unmask the survivors' sum (their weighted mean, their count and total weight)."""
        state: _Round = self.scratch(step, _Round)
        if state.secure is None or not step.nodes:
            return []
        try:
            survivors = state.secure.masked_inputs(state.uploads)
            mean, count, weight = state.secure.unmask(_stages(exchange), survivors)
            state.revealed = Partial.of_mean(mean, weight, count, members=tuple(survivors), planned=state.planned)
        except SecAggError as error:  # the sum cannot be unmasked: the round changes nothing
            self._abandon(step, state, error)
        return self._failures(state)

    def release(self, step: Step, partial: Partial) -> Partial:
        """The unmasked sum in place of the clear one (which holds nothing: every upload was masked);
        an empty partial when the round could not unmask, so the step changes nothing."""
        state: _Round = self.scratch(step, _Round)
        assert not partial.count, "arrived() takes every reply of a secure round: none reaches the clear sum"
        return state.revealed if state.revealed is not None else Partial.empty(partial.numel, planned=state.planned)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        state: _Round = self.scratch(step, _Round)
        outcome.notes.extend(state.notes)
        if state.secure is None:
            return
        tally.uplink += state.secure.uplink
        tally.downlink += state.secure.downlink
        outcome.extra.update({"secure_aggregation": self.spec.spec, "secagg_ring_bits": state.secure.plan.bits,
                              "secagg_neighbours": state.secure.plan.degree,
                              "secagg_consistency": state.secure.plan.consistency})

    def _abandon(self, step: Step, state: _Round, error: SecAggError) -> None:
        log.error("round %d: secure aggregation failed: %s; global model unchanged", step.number, error)
        state.notes.append({"node": None, "reason": f"secure aggregation failed: {error}"})

    def describe(self) -> dict[str, Any]:
        return {"secure_aggregation": self.spec.spec}

    def state_dict(self) -> dict[str, Any]:
        return {"run-id": self.run_id.hex(), "pins": {str(node): raw.hex() for node, raw in sorted(self.pins.items())}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A resumed run keeps its run id and its identity pins (a checkpoint from before they were
        kept gets a fresh id and no pins)."""
        if state is None:
            return
        raw = bytes.fromhex(str(state.get("run-id", "")))
        if len(raw) != 16:
            raise ValueError("the checkpoint's secure-aggregation run id is not 16 bytes")
        pins = {}
        for node, key in dict(state.get("pins", {})).items():
            pin = bytes.fromhex(str(key))
            if len(pin) != 32:
                raise ValueError(f"the checkpoint's identity pin of node {node} is not 32 bytes")
            pins[int(node)] = pin
        self.run_id = raw
        self.pins.clear()
        self.pins.update(pins)
