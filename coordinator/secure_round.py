"""One round with secure aggregation on a coordinator: the four exchanges around the train message.

The coordinator (Fedge's engine, or ``fedge.flower.secure`` in a user's ServerApp) runs each stage
through the :data:`~fedge.coordinator.step.Exchange` it gives every step, each with its own timeout,
and carries on with whoever answered: a device that misses the advertisement or the share stage is
simply not in the sum; one that dealt shares and then vanished (the hard case) has its
pairwise masks removed from the survivors' uploads with the key shares its neighbours reveal. What
the coordinator ends with is the exact sum of the survivors' quantized, weighted updates and the sum
of their weights, hence the weighted mean, and nothing about any one of them.

Identity keys are pinned on first use, per node, for the whole run: a device that later presents
another identity is refused (logged). With an issuer (``secagg:issuer=ca.crt``) nothing is trusted
on first use: each identity must come with a credential from the operator's CA, the devices check
their peers' credentials themselves, and a consistency round (every survivor signs the survivor
set; each device checks a quorum of signatures) runs before anyone unmasks. See SECURITY.md.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from flwr.app import MessageType, RecordDict

from fedge.compression import derive_seed
from fedge.privacy.credentials import Credential, check_distinct, verify_credential
from fedge.privacy.distributed_dp import SkellamParams, centred, decode_sum
from fedge.privacy.errors import SecAggError, UnmaskError
from fedge.privacy.keys import RoundContext
from fedge.privacy.messages import masked_size
from fedge.privacy.plan import SecAggPlan
from fedge.privacy.secagg_server import SecAggServer
from fedge.privacy.shared_grid import SharedGrid
from fedge.privacy.spec import SecAggSpec
from fedge.coordinator.door import door
from fedge.protocol.failures import REFUSALS, Failure, FailureKind
from fedge.protocol.records import ProtocolError
from fedge.coordinator.step import Exchange, Outgoing, Reply
from fedge.protocol.secagg import (
    MASKED_STAGE,
    SECAGG_RECORD,
    config_bytes,
    pack_blobs,
    pack_ids,
    plan_record,
    unpack_blobs,
)

__all__ = ["SecureRound", "check_noisy_range", "check_range"]

log = logging.getLogger(__name__)


def check_range(plan: SecAggPlan, level_sum: np.ndarray, count: int) -> None:
    """What the coordinator can check of an unmasked sum (audit M3): every coordinate of ``count``
    honest uploads lies in [0, count (2^b - 1)], and their weights sum to at least ``count`` (every
    device counts at least one example) and at most ``count`` times the cap. A device that put other
    ring values into its upload is caught when it leaves these bounds; one that stays inside them
    (say, subtracting from the others' weights down to ``count``) is not: SECURITY.md, "Not
    protected". Raises :class:`SecAggError`: the round changes nothing."""
    grid = plan.grid
    values, digits = level_sum[: -grid.weight_digits], level_sum[-grid.weight_digits:]
    top = count * grid.top
    if values.size and int(values.max()) > top:
        raise UnmaskError(f"the unmasked sum has a coordinate above {count} devices' highest level ({top}): "
                          "a device sent values outside the grid; the round is discarded")
    weight = grid.weight_sum(digits)
    if int(digits.max(initial=0)) > top or not count <= weight <= count * grid.weight_cap:
        raise UnmaskError(f"the unmasked weights sum to {weight}, outside [{count}, {count * grid.weight_cap}] for "
                          f"{count} devices: a device sent values outside the grid; the round is discarded")


def check_noisy_range(plan: SecAggPlan, level_sum: np.ndarray, count: int) -> None:
    """Under distributed DP: no coordinate of ``count`` honest noisy vectors exceeds, in magnitude,
    count x the rounded norm bound plus the noise's tail bound (the bounds the ring was sized by);
    a larger one means a device sent values outside them, and the round is discarded."""
    assert plan.noise is not None
    bound = plan.noise.magnitude(count)
    signed = centred(level_sum, plan.bits)
    if signed.size and int(np.abs(signed).max()) > bound:
        raise UnmaskError(f"the unmasked noisy sum has a coordinate beyond {bound} for {count} devices: a device "
                          "sent values outside the bounds; the round is discarded")


class SecureRound:
    """Stages 1, 2 and 4 around the algorithm's train messages (stage 3)."""

    def __init__(self, spec: SecAggSpec, run_id: bytes, seed: int, number: int, nodes: list[int], dimension: int,
                 pins: dict[int, bytes], *, weighted: bool = True, issuer: Any = None,
                 noise: SkellamParams | None = None) -> None:
        self.spec = spec
        # an algorithm that counts every reply once (EASGD) sends weight 1 on a grid capped at 1, and
        # so does every device under distributed DP (each weighs 1 in the noisy sum): one plan whichever
        # coordinator asks, not the cap of a weight nobody sends
        weighted = weighted and noise is None
        sent = max(1, math.ceil(spec.ratio * dimension)) if spec.ratio < 1 else dimension
        self.plan = SecAggPlan(RoundContext(run_id, number), tuple(sorted(nodes)),
                               SharedGrid(spec.bits, spec.clip, spec.weight_cap if weighted else 1), sent,
                               graph_seed=derive_seed(seed, number, purpose="secagg-graph"),
                               neighbours=spec.neighbours, threshold=spec.threshold,
                               model_size=dimension if sent < dimension else 0,
                               support_seed=derive_seed(seed, number, purpose="secagg-support"),
                               consistency=issuer is not None, noise=noise)
        self.issuer = issuer
        self.pins = pins
        self.server: SecAggServer | None = None
        self.uplink = 0
        self.downlink = 0
        self.missing: dict[int, str] = {}
        #: the kind of each drop that is not the protocol's own (a device's typed refusal: its policy)
        self.kinds: dict[int, FailureKind] = {}
        self._routed_ads: dict[int, dict] = {}  # device -> its neighbours' accepted advertisements
        self._identities: dict[int, bytes] = {}  # device -> its pinned identity key
        self._credentials: dict[int, bytes] = {}  # device -> its credential from the operator's CA
        self._inbox: dict[int, dict[int, bytes]] = {}
        self._reported: set[int] = set()
        #: the masked uploads taken so far (stage 3), checked against the plan, by node
        self.uploads: dict[int, bytes] = {}

    @property
    def planned(self) -> int:
        """The nodes planned into the round (under distributed DP each adds 1/planned of the noise)."""
        return len(self.plan.participants)

    # -- the round's flow, as both coordinators drive it ------------------------------------------
    def open(self, exchange: Exchange) -> list[int]:
        """Stages 1 and 2: the nodes that dealt their shares, the only ones to train. Raises
        :class:`SecAggError` when the round cannot start."""
        self.advertise(exchange)
        return self.share(exchange)

    def take(self, node: int, metrics: Any, payload: bytes | memoryview) -> None:
        """Hold ``node``'s masked upload once :meth:`check_upload` passed (ProtocolError otherwise)."""
        self.uploads[node] = self.check_upload(metrics, payload)

    def reveal(self, exchange: Exchange) -> tuple[torch.Tensor, int, int, list[int]]:
        """Stage 4 over the uploads taken: (the survivors' weighted mean, their count, their total
        weight, the survivors). Raises :class:`SecAggError` when the sum cannot be unmasked."""
        survivors = self.masked_inputs(self.uploads)
        mean, count, weight = self.unmask(exchange, survivors)
        return mean, count, weight, survivors

    # -- what both coordinators check and report ------------------------------------------------
    def check_upload(self, metrics: Any, payload: bytes | memoryview) -> bytes:
        """A masked reply's upload, checked against the plan before it is held: exactly the size the
        plan expects (its header and ring elements are decoded once, when the round unmasks), and
        metrics that say nothing in clear about the device's data (``num-examples`` 1, no loss).
        Raises :class:`ProtocolError` with the reason."""
        if metrics.get("num-examples") != 1 or any("loss" in str(key) for key in metrics):
            raise ProtocolError("a masked reply reports nothing about its data in clear: num-examples 1, no "
                                "train-loss")
        expected = masked_size(self.plan.length, self.plan.bits)
        if len(payload) != expected:
            raise ProtocolError(f"malformed masked upload: {len(payload)} bytes, the plan expects {expected}")
        return bytes(payload)

    def dropped(self) -> list[Failure]:
        """The nodes the protocol dropped since the last call, with why, each once: kind ``secagg``,
        or the kind a device's refusal named (``policy``: a round its operator's policy forbids)."""
        fresh = sorted((n, r) for n, r in self.missing.items() if n not in self._reported)
        self._reported.update(n for n, _ in fresh)
        return [Failure(n, self.kinds.get(n, FailureKind.SECAGG), r) for n, r in fresh]

    # -- stage 1 ----------------------------------------------------------------------------------
    def advertise(self, exchange: Exchange) -> None:
        ads: dict[int, bytes] = {}
        identities: dict[int, Ed25519PublicKey] = {}
        raw_keys: dict[int, bytes] = {}
        endorsed: dict[int, Credential] = {}  # the verified credentials accepted so far
        for reply in self._ask(exchange, {n: {} for n in self.plan.participants}, "advertise"):
            node, record = reply
            raw = bytes(record.get("identity", b""))
            if self.issuer is not None:
                try:
                    credential = bytes(record.get("credential", b""))
                    self._credentials[node] = credential
                    verified = verify_credential(credential, raw, self.issuer)
                    log.debug("round %d: node %d is %r, issued by the operator", self.plan.context.round, node,
                              verified.name)
                except SecAggError as error:
                    self._drop(node, f"identity not issued by the operator: {error}")
                    continue
                # one endorsement, one participant (audit 2, N2): the devices' own check, here refusing
                # the later of two identities bound by one node key or name
                try:
                    check_distinct({**endorsed, node: verified})
                except SecAggError as error:
                    self._drop(node, str(error))
                    continue
                endorsed[node] = verified
            pinned = self.pins.get(node)
            if pinned is not None and pinned != raw:
                self._drop(node, "presented another identity key than the one pinned at its first round")
                continue
            try:
                identities[node] = Ed25519PublicKey.from_public_bytes(raw)
            except ValueError:
                self._drop(node, "sent a malformed identity key")
                continue
            raw_keys[node] = raw
            ads[node] = bytes(record.get("ad", b""))
        self.server = SecAggServer(self.plan, identities)
        self._routed_ads = self.server.receive_advertisements(ads)
        self.missing.update(self.server.refused)
        # Pinned only once its advertisement verified under it: a malformed first reply (or one
        # forged in transit) must not lock the node out of the run with a key it never held.
        for node, raw in raw_keys.items():
            if node not in self.server.refused:
                self.pins.setdefault(node, raw)
        self._identities = {n: raw_keys[n] for n in self._routed_ads}

    # -- stage 2 ----------------------------------------------------------------------------------
    def share(self, exchange: Exchange) -> list[int]:
        """The devices that dealt their shares: the ones to train (stage 3)."""
        assert self.server is not None
        asks = {}
        for node, peers in self._routed_ads.items():
            ids, ads = pack_blobs({p: ad.to_bytes() for p, ad in peers.items()})
            _, identities = pack_blobs({p: self._identities[p] for p in peers})
            asks[node] = {"ad-from": ids, "ads": ads, "identities": identities}
            if self.issuer is not None:
                asks[node]["credentials"] = pack_blobs({p: self._credentials[p] for p in peers})[1]
        sealed = {}
        for node, record in self._ask(exchange, asks, "share"):
            try:
                sealed[node] = unpack_blobs(record["sealed-to"], record["sealed"])
            except (KeyError, SecAggError) as error:
                self._drop(node, f"malformed shares: {error}")
        self._inbox = self.server.route_shares(sealed)
        self.missing.update(self.server.refused)
        return sorted(n for n in sealed if n not in self.server.refused)

    def train_record(self, node: int):  # type: ignore[no-untyped-def]
        """The secagg record a stage-3 train message carries: the plan and the shares dealt to ``node``."""
        ids, blobs = pack_blobs(self._inbox.get(node, {}))
        record = plan_record(self.plan, MASKED_STAGE, **{"shares-from": ids, "shares": blobs})
        self.downlink += config_bytes(record)
        return record

    # -- stage 3 (the engine's train exchange) ----------------------------------------------------
    def masked_inputs(self, uploads: dict[int, bytes]) -> list[int]:
        """The survivors: devices whose masked upload (taken through the engine's door) is well formed."""
        assert self.server is not None
        survivors = self.server.receive_masked(uploads)
        self.missing.update(self.server.refused)
        return survivors

    # -- the consistency round (with an issuer) ---------------------------------------------------
    def consistency(self, exchange: Exchange, survivors: list[int]) -> list[int]:
        """Every survivor signs the survivor set; the ones whose signature verified (a quorum, else
        the round aborts) are the ones asked to unmask."""
        assert self.server is not None
        asks = {n: {"survivors": pack_ids(survivors)} for n in survivors}
        signatures = {node: bytes(record.get("signature", b"")) for node, record in
                      self._ask(exchange, asks, "consistency")}
        try:
            return sorted(self.server.receive_consistency(signatures))
        finally:
            self.missing.update(self.server.refused)

    # -- stage 4 ----------------------------------------------------------------------------------
    def unmask(self, exchange: Exchange, survivors: list[int]) -> tuple[torch.Tensor, int, int]:
        """(the weighted mean of the survivors' updates, the number of survivors, their total weight).
        With the consistency round, only the devices that signed are asked, and each gets every
        signature with the signers' identities and credentials to check before it reveals."""
        assert self.server is not None
        asked = survivors
        extra: dict[str, Any] = {}
        if self.plan.consistency:
            asked = self.consistency(exchange, survivors)
            signers, signatures = pack_blobs(self.server.signatures)
            extra = {"signers": signers, "signatures": signatures,
                     "identities": pack_blobs({n: self._identities[n] for n in self.server.signatures})[1],
                     "credentials": pack_blobs({n: self._credentials[n] for n in self.server.signatures})[1]}
        asks = {n: {"survivors": pack_ids(survivors), **extra} for n in asked}
        reveals = {node: bytes(record.get("reveals", b"")) for node, record in self._ask(exchange, asks, "unmask")}
        level_sum, count = self.server.unmask(reveals)
        if self.plan.noise is not None:  # distributed DP: the noisy sum of clipped updates, each weighing 1
            check_noisy_range(self.plan, level_sum, count)
            total, weight = decode_sum(level_sum, self.plan.noise, self.plan.bits), count
            mean = total / count
            return torch.from_numpy(mean.astype(np.float32)), count, weight
        check_range(self.plan, level_sum, count)
        mean, weight = self.plan.grid.weighted_mean(level_sum, count)
        support = self.plan.support
        if support is not None:  # random-k: the sent coordinates back in place, the others unchanged
            full = np.zeros(self.plan.model_size, dtype=np.float64)
            full[support] = mean
            mean = full
        return torch.from_numpy(mean.astype(np.float32)), count, weight

    # -- helpers ----------------------------------------------------------------------------------
    def _ask(self, exchange: Exchange, asks: dict[int, dict], stage: str):  # type: ignore[no-untyped-def]
        outgoing = []
        for node, fields in asks.items():
            record = plan_record(self.plan, stage, **fields)
            self.downlink += config_bytes(record)
            # train messages with the secagg record: Flower's SecAgg+ convention (no handler of its own)
            outgoing.append(Outgoing(node, RecordDict({SECAGG_RECORD: record}), MessageType.TRAIN))
        taken: list[tuple[int, Any]] = []

        def take(reply: Reply) -> None:
            record = reply.content.config_records.get(SECAGG_RECORD)
            if record is None:
                raise ProtocolError("reply without a secagg record")
            taken.append((reply.node, record))

        for item in exchange(outgoing, self.spec.timeout, f"secagg-{stage}"):
            # the one door every reply passes: a node that did not answer, an error reply, the
            # device's own refusal (a round too small for its policy, ...) or a malformed reply
            failure = door(self.plan.context.round, item, take, what=f"secagg-{stage} reply")
            if failure is not None:
                assert failure.node is not None
                self._drop(failure.node, f"{stage}: {failure.reason}")
                if failure.kind in REFUSALS:
                    self.kinds[failure.node] = failure.kind
                continue
            node, record = taken.pop()
            self.uplink += config_bytes(record)
            yield node, record

    def _drop(self, node: int, reason: str) -> None:
        self.missing[node] = reason
        log.warning("round %d: secure aggregation without node %d: %s", self.plan.context.round, node, reason)
