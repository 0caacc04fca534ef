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
from dataclasses import dataclass, field
from typing import Any

from flwr.app import MessageType

from fedge.aggregation.partial import Partial
from fedge.privacy.credentials import CredentialError
from fedge.privacy.distributed_dp import round_noise
from fedge.privacy.dp_spec import DPSpec, parse_differential_privacy
from fedge.privacy.errors import SecAggError
from fedge.privacy.spec import parse_secure_aggregation
from fedge.server.engine.algorithm import Algorithm, Outgoing, Reply, Step, StepOutcome
from fedge.protocol.dispatcher import Missing
from fedge.protocol.layer import MODEL, SUM, Exchange, Failure, Layer
from fedge.protocol.secagg import SECAGG_RECORD
from fedge.protocol.secure_round import SecureRound, StageExchange
from fedge.protocol.secure_session import SecureSession
from fedge.protocol.tally import Tally
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
    """One round: its protocol state (``fedge.protocol.secure_round``), its revealed sum, what went wrong."""

    secure: SecureRound | None = None
    #: the survivors' unmasked sum, once stage 4 succeeded
    revealed: Partial | None = None
    notes: list[dict[str, Any]] = field(default_factory=list)


class SecureAggregationLayer(Layer):
    """The engine's adapter over the one flow both coordinators run (``fedge.protocol.secure_session``)."""

    key = "secure-aggregation"
    provides = frozenset({SUM})
    needs = frozenset({MODEL})  # its record rides on the message that carries the model

    def __init__(self, session: SecureSession, algorithm: Algorithm, dp_spec: DPSpec | None = None) -> None:
        self.session, self.spec = session, session.spec
        #: with differential privacy: the devices add Skellam noise inside the ring (distributed DP)
        self.dp_spec = dp_spec
        self.numel = algorithm.ctx.numel
        self.weighted = algorithm.weighted

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
        try:
            session = SecureSession(spec, algorithm.ctx.settings.seed)
        except CredentialError as err:
            raise SettingsError(f"secure-aggregation: {err}") from None
        return cls(session, algorithm, dp)

    def open(self, step: Step, exchange: Exchange) -> list[Failure]:
        """Stages 1 and 2: advertise, share. Only the devices that dealt their shares train."""
        state: _Round = self.scratch(step, _Round)
        try:
            noise = None if self.dp_spec is None else round_noise(self.dp_spec, self.numel, len(step.nodes))
            state.secure = self.session.round(step.number, step.nodes, self.numel, weighted=self.weighted,
                                              noise=noise)
            step.nodes = state.secure.open(_stages(exchange))
        except SecAggError as error:  # the round cannot go on (a CredentialError too): nobody trains
            self._abandon(step, state, error)
            step.nodes = []
        return state.secure.dropped() if state.secure is not None else []

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        state: _Round = self.scratch(step, _Round)
        if state.secure is None:  # the round could not be planned: nothing is sent
            return
        for o in outgoing:
            o.content[SECAGG_RECORD] = state.secure.train_record(o.node)

    def arrived(self, step: Step, reply: Reply, payload: memoryview, metrics: dict[str, float]) -> bool:
        """A masked upload, already screened with its metrics checked, held once its size is what
        the plan expects (a bad header or ring element drops its device when the round unmasks)."""
        state: _Round = self.scratch(step, _Round)
        assert state.secure is not None
        state.secure.take(reply.node, metrics, payload)
        return True

    def settle(self, step: Step, exchange: Exchange, tally: Tally) -> list[Failure]:
        """Stage 4: unmask the survivors' sum (their weighted mean, their count and total weight)."""
        state: _Round = self.scratch(step, _Round)
        if state.secure is None or not step.nodes:
            return []
        try:
            mean, count, weight, survivors = state.secure.reveal(_stages(exchange))
            state.revealed = Partial.of_mean(mean, weight, count, members=tuple(survivors),
                                             planned=state.secure.planned)
        except SecAggError as error:  # the sum cannot be unmasked: the round changes nothing
            self._abandon(step, state, error)
        return state.secure.dropped()

    def release(self, step: Step, partial: Partial) -> Partial:
        """The unmasked sum in place of the clear one (which holds nothing: every upload was masked);
        an empty partial when the round could not unmask, so the step changes nothing."""
        state: _Round = self.scratch(step, _Round)
        assert not partial.count, "arrived() takes every reply of a secure round: none reaches the clear sum"
        planned = state.secure.planned if state.secure is not None else 0
        return state.revealed if state.revealed is not None else Partial.empty(partial.numel, planned=planned)

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

    def _abandon(self, step: Step, state: _Round, error: Exception) -> None:
        log.error("round %d: secure aggregation failed: %s; global model unchanged", step.number, error)
        state.notes.append({"node": None, "reason": f"secure aggregation failed: {error}"})

    def describe(self) -> dict[str, Any]:
        return {"secure_aggregation": self.spec.spec}

    def state_dict(self) -> dict[str, Any]:
        return self.session.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.session.load_state_dict(state)
