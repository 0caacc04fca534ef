"""Secure aggregation as a layer, once for both coordinators: the coordinator learns only the sum of
a round's updates (``fedge.coordinator.secure_round`` runs the protocol's stages).

Around a step: before its messages go out (``outgoing``), the layer runs the key agreement
(advertise, share), narrows the step to the devices that dealt their shares and keeps the others'
messages back; it staples each message it lets go with the plan and the shares for that device;
each masked reply comes through the door like any other (screened, its metrics checked) and the
layer takes it whole, after checking its size against the plan; after the replies (``release``) it
unmasks the survivors' sum and releases it as the step's
:class:`~fedge.aggregation.partial.Partial`, in place of the clear one, which holds nothing. A
device the protocol drops at any stage goes to ``step.drop``.

Fedge's engine builds it in ``server/engine/layers/__init__.py`` (which adds what its
settings refuse); a user's ServerApp runs the same class through ``fedge.flower.secure``, which is
``fedge.flower.layered`` with this layer. What differs between them is only how a stage reaches the
devices (the :data:`~fedge.coordinator.step.Exchange` each coordinator gives the step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any


from fedge.aggregation.partial import Partial
from fedge.privacy.distributed_dp import round_noise
from fedge.privacy.dp_spec import DPSpec
from fedge.privacy.errors import SecAggError
from fedge.protocol.config_keys import WEIGHT_KEY
from fedge.coordinator.layer import Failure, MEMBERS, SUM, Layer
from fedge.protocol.records import CONFIG_RECORD
from fedge.protocol.secagg import SECAGG_RECORD
from fedge.coordinator.secure_round import SecureRound
from fedge.coordinator.secure_session import SecureSession
from fedge.coordinator.step import Outgoing, Reply, Step, StepOutcome
from fedge.coordinator.tally import Tally

__all__ = ["SecureAggregation"]

log = logging.getLogger(__name__)


@dataclass
class _Round:
    """One round: its protocol state (``fedge.coordinator.secure_round``), its revealed sum, what went wrong."""

    secure: SecureRound | None = None
    #: the survivors' unmasked sum, once stage 4 succeeded
    revealed: Partial | None = None
    notes: list[dict[str, Any]] = field(default_factory=list)


class SecureAggregation(Layer):
    """The layer both coordinators run over one flow (``fedge.coordinator.secure_session``)."""

    key = "secure-aggregation"
    #: the step's sum, and which of its messages go out (what counts or encodes them runs after it)
    provides = frozenset({SUM, MEMBERS})

    def __init__(self, session: SecureSession, numel: int = 0, *, weighted: bool = True,
                 dp_spec: DPSpec | None = None, weight_key: str | None = None) -> None:
        if dp_spec is not None and session.spec.ratio < 1:
            raise ValueError("secure aggregation with ratio < 1 (random-k) cannot carry distributed DP: the noise "
                             "and the sensitivity cover the whole update; use ratio=1")
        self.session, self.spec = session, session.spec
        #: with differential privacy: the devices add Skellam noise inside the ring (distributed DP)
        self.dp_spec = dp_spec
        #: the update's length (0: taken from the first model, in ``start``)
        self.numel = int(numel)
        self.weighted = weighted
        #: the metric a Flower app's device weighs its update by ("": every device weighs 1), written
        #: into each message; None (Fedge's engine): its devices weigh by their example count
        self.weight_key = weight_key

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        """Stages 1 and 2 among the step's nodes: advertise, share. Only the devices that dealt their
        shares get their message, with the plan and their shares; the others' are kept back."""
        state: _Round = self.scratch(step, _Round)
        if not self.numel:  # a Flower app's layer: sized by its first model
            self.numel = next((int(o.model.numel()) for o in outgoing if o.model is not None), 0)
        try:
            noise = None if self.dp_spec is None else round_noise(self.dp_spec, self.numel, len(step.nodes))
            state.secure = self.session.round(step.number, step.nodes, self.numel, weighted=self.weighted,
                                              noise=noise)
            step.nodes = state.secure.open(step.exchange)
        except SecAggError as error:  # the round cannot go on (a CredentialError too): nobody trains
            self._abandon(step, state, error)
            step.nodes = []
        self._dropped(step, state)
        kept = set(step.nodes)
        outgoing[:] = [o for o in outgoing if o.node in kept]
        for o in outgoing:
            assert state.secure is not None
            o.content[SECAGG_RECORD] = state.secure.train_record(o.node)
            if self.weight_key is not None:
                o.content.config_records[CONFIG_RECORD][WEIGHT_KEY] = self.weight_key

    def arrived(self, step: Step, event: Reply | Failure) -> bool:
        """A masked upload, already screened with its metrics checked, held once its size is what
        the plan expects (a bad header or ring element drops its device when the round unmasks)."""
        if isinstance(event, Failure):
            return False
        state: _Round = self.scratch(step, _Round)
        if state.secure is None:
            raise SecAggError("a reply to a round whose secure aggregation could not start")
        assert event.payload is not None and event.metrics is not None  # the door read them
        state.secure.take(event.node, event.metrics, event.payload)
        return True

    def release(self, step: Step, partial: Partial) -> Partial:
        """Stage 4: unmask the survivors' sum (their weighted mean, their count and total weight) and
        release it in place of the clear one (which holds nothing: every upload was masked); an
        empty partial when the round could not unmask, so the step changes nothing."""
        state: _Round = self.scratch(step, _Round)
        assert not partial.count, "arrived() takes every reply of a secure round: none reaches the clear sum"
        if state.secure is None:
            return Partial.empty(partial.numel)
        if step.nodes:
            try:
                mean, count, weight, survivors = state.secure.reveal(step.exchange)
                state.revealed = Partial.of_mean(mean, weight, count, members=tuple(survivors),
                                                 planned=state.secure.planned)
            except SecAggError as error:  # the sum cannot be unmasked: the round changes nothing
                self._abandon(step, state, error)
            self._dropped(step, state)
        return state.revealed if state.revealed is not None else Partial.empty(partial.numel,
                                                                                planned=state.secure.planned)

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

    @staticmethod
    def _dropped(step: Step, state: _Round) -> None:
        for failure in state.secure.dropped() if state.secure is not None else []:
            step.drop(failure)

    def _abandon(self, step: Step, state: _Round, error: Exception) -> None:
        log.error("round %d: secure aggregation failed: %s; no device's update this round", step.number, error)
        state.notes.append({"node": None, "reason": f"secure aggregation failed: {error}"})

    def describe(self) -> dict[str, Any]:
        return {"secure_aggregation": self.spec.spec}

    def state_dict(self) -> dict[str, Any]:
        return self.session.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.session.load_state_dict(state)
