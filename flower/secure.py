"""``secure(strategy, secure_aggregation="secagg:...")``: a user's strategy that sees only the sum.

The wrapper runs Fedge's secure aggregation (``fedge.protocol.secure_round``: pairwise masks over a
neighbourhood graph, Shamir shares of the mask seeds and keys, signed advertisements, exact sums
when devices drop out) around the wrapped strategy's round, from a user's own ServerApp against its
``Grid``; :func:`fedge.edge_client.secure_mod` is the device's side. Around ``configure_train`` it
advertises keys and routes the sealed shares among the nodes the strategy sampled (two exchanges
on the grid), and only the nodes that dealt their shares train; each masked reply is checked
against the plan (its size, and that it says nothing in clear about its data); at
``aggregate_train`` the survivors reveal what unmasks their sum, and the wrapped strategy
aggregates one reply: the current model plus the survivors' weighted mean update. So FedAvg,
FedProx, FedAvgM and the server optimizers (FedAdam, FedYogi, FedAdagrad) step from the mean as
they always do; a strategy that needs each update (FedMedian, Krum, trimmed mean, Bulyan, ...) is
refused when it is wrapped, as Fedge's own runs refuse robust aggregators with secure aggregation.

The stage messages are ``train`` messages carrying the ``secagg`` record, the convention of
Flower's own SecAgg+ (``secaggplus_mod``): the user's ClientApp needs no handler of its own for
them; the mod answers them and calls the user's ``@app.train()`` body only for the masked round.
What the coordinator learns: the sum over the survivors and which nodes took part at each stage;
with ``differential_privacy=...`` (``fedge.flower.secure_dp``) that sum carries the devices' noise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvgM, Strategy
from flwr.serverapp.strategy.fedopt import FedOpt

from fedge.protocol.layout import Layout
from fedge.flower.messages import Wrapper, grid_stages
from fedge.protocol.config_keys import UPLINK_KEYS, WEIGHT_KEY
from fedge.protocol.records import MODEL_RECORD, ProtocolError, UPDATE_RECORD, read_payload
from fedge.flower.secure_dp import DistributedDP, parsed
from fedge.flower.strategy import CompressedStrategy, is_plain_mean
from fedge.privacy.errors import SecAggError
from fedge.privacy.spec import parse_secure_aggregation
from fedge.protocol.secagg import SECAGG_RECORD
from fedge.protocol.secure_round import SecureRound
from fedge.protocol.secure_session import SecureSession

__all__ = ["distributed_dp", "SecureStrategy", "refuse_reason", "secure"]

log = logging.getLogger(__name__)


def refuse_reason(strategy: Strategy) -> str | None:
    """Why ``strategy`` cannot run on a securely aggregated sum (None: it can). ``secure(compressed(s,
    uplink="none", downlink="lattice:..."))`` composes: the lattice downlink ships the model, secure
    aggregation is the uplink."""
    if isinstance(strategy, CompressedStrategy):
        if strategy.uplink_codec.spec != "none":
            return ("secure aggregation quantizes each update itself (secagg:bits=...) and the coordinator never "
                    "sees one to decode: give compressed() uplink=\"none\" (its downlink still applies), or wrap "
                    "the strategy with secure(...) alone")
        strategy = strategy.strategy
    name = type(strategy).__name__
    if is_plain_mean(strategy) or isinstance(strategy, (FedOpt, FedAvgM)):
        return None  # the weighted mean, then (for these) a server step from it
    return (f"{name} aggregates each update itself (it ranks, trims or reweights them); secure aggregation "
            "only reveals their sum")


class SecureStrategy(Wrapper):
    """``strategy`` over securely aggregated updates (see the module docstring)."""

    #: what another wrapper asks before it wraps this one: updates leave the devices masked
    masks_updates = True

    def __init__(self, strategy: Strategy, secure_aggregation: str = "secagg:bits=8,clip=0.2,weight-cap=256",
                 seed: int = 0, differential_privacy: str = "none") -> None:
        reason = refuse_reason(strategy)
        if reason is not None:
            raise ValueError(f"secure aggregation cannot wrap {type(strategy).__name__}: {reason}")
        spec = parsed(parse_secure_aggregation, secure_aggregation, "secure_aggregation")
        if spec.issuer:
            raise ValueError("issuer= (identities issued by the operator) needs Fedge's coordinator (fedge serve); "
                             "in a user's ServerApp identity keys are pinned on first use")
        self.strategy, self.spec, self.seed = strategy, spec, int(seed)
        #: distributed DP (``fedge.flower.secure_dp``): the devices add Skellam noise inside the ring
        self.dp: DistributedDP | None = None
        if differential_privacy and differential_privacy.strip().lower() != "none":
            if spec.ratio < 1:
                raise ValueError("secure aggregation with ratio < 1 (random-k) cannot carry distributed DP: the "
                                 "noise and the sensitivity cover the whole update; use ratio=1")
            if isinstance(strategy, CompressedStrategy) and strategy.downlink.spec != "none":
                raise ValueError("distributed DP samples nodes itself and re-addresses one train message to each, "
                                 "which a per-node lattice downlink cannot be; use compressed(...) without one")
            self.dp = DistributedDP(differential_privacy, float(getattr(strategy, "fraction_train", 0.0)))
        #: the run id, the identity pins (trust on first use) and each round's flow, shared with Fedge's engine
        self.session = SecureSession(spec, self.seed)
        self._round: _Round | None = None
        self.refused: list[tuple[int, int, str]] = []  # (round, node, reason) left out of a sum

    # -- train ----------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Stages 1 and 2 on the grid among the nodes the wrapped strategy sampled (under DP: a
        Poisson sample of the connected nodes); the ones that dealt their shares get the train
        message with the plan and their shares."""
        self._round = None
        layout = Layout(arrays)
        connected, noise = 0, None
        if self.dp is None:
            messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        else:  # Poisson sampling, each node with its own copy of the strategy's train message
            self.dp.numel = layout.numel
            all_nodes = list(grid.get_node_ids())
            connected = len(all_nodes)
            if self.dp.exhausted(self.dp.rate):
                return []
            template = next(iter(self.strategy.configure_train(server_round, arrays, config, grid)), None)
            if template is None:
                return []
            messages = [Message(RecordDict(dict(template.content.items())), node, MessageType.TRAIN,
                                group_id=str(server_round)) for node in self.dp.sample(all_nodes)]
        if isinstance(self.strategy, CompressedStrategy):  # its downlink ships the model; the uplink is ours
            for message in messages:
                for key in UPLINK_KEYS:
                    message.content.config_records["config"].pop(key, None)
        nodes = sorted({m.metadata.dst_node_id for m in messages})
        if self.dp is not None:
            noise = self.dp.noise(len(nodes))  # each planned node's share of the round's noise
        state = _Round(server_round, None, layout, arrays, grid, connected, len(nodes))
        self._round = state  # under DP a round with no sum still releases noise
        if len(nodes) < 2:
            log.warning("round %d: secure aggregation needs at least 2 nodes, %d sampled: no training this round",
                        server_round, len(nodes))
            return []
        weighted = "" if self.dp is not None else str(getattr(self.strategy, "weighted_by_key", ""))
        secure = self.session.round(server_round, nodes, layout.numel, weighted=bool(weighted), noise=noise)
        try:
            dealt = set(secure.open(grid_stages(grid, server_round)))
        except SecAggError as error:
            log.error("round %d: secure aggregation could not start: %s; no training this round", server_round, error)
            return []
        self._note(server_round, secure)
        out = []
        for message in messages:
            node = message.metadata.dst_node_id
            if node not in dealt:
                continue
            content = RecordDict(dict(message.content.items()))  # each node its own record
            content[SECAGG_RECORD] = secure.train_record(node)
            train_config = ConfigRecord(dict(content.config_records.get("config", ConfigRecord())))
            train_config[WEIGHT_KEY] = weighted
            content["config"] = train_config
            message.content = content
            out.append(message)
        state.secure = secure
        return out

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Stage 4: the survivors unmask their sum; the wrapped strategy aggregates the one reply
        that carries the current model plus their weighted mean update. Its metrics gain
        ``fedge-secagg-survivors`` and ``fedge-uplink-bytes`` (masked uploads and key exchange)."""
        replies = list(replies)
        state, self._round = self._round, None
        if state is None or state.number != server_round:
            return None, None
        secure, count = state.secure, 0
        members: list[int] = []
        mean: np.ndarray | None = None
        if secure is not None:
            self._take(server_round, secure, replies)
            try:
                revealed, count, _, members = secure.reveal(grid_stages(state.grid, server_round))
                mean = revealed.numpy().astype(np.float64)
            except SecAggError as error:
                log.error("round %d: secure aggregation failed: %s; no device's update this round", server_round, error)
            self._note(server_round, secure)
        if self.dp is not None:  # the devices' noisy sum over q N, or noise alone: never a noiseless release
            mean = self.dp.release(None if mean is None else mean * count, self.dp.rate, state.connected, members,
                                   state.planned, self.dp.rng)
        elif mean is None:
            return None, None
        stepped = state.layout.rebuild(state.layout.flatten(state.arrays) + mean, state.arrays)
        key = getattr(self.strategy, "weighted_by_key", "num-examples")
        one = Message(RecordDict({MODEL_RECORD: stepped, "metrics": MetricRecord({key: 1})}),
                      reply_to=Message(RecordDict(), dst_node_id=0, message_type=MessageType.TRAIN))
        if isinstance(self.strategy, CompressedStrategy):  # its downlink settles on the real replies
            aggregated, metrics = self.strategy.aggregate_released(server_round, replies, [one])
        else:
            aggregated, metrics = self.strategy.aggregate_train(server_round, [one])
        metrics = MetricRecord(dict(metrics or {}))
        metrics["fedge-secagg-survivors"] = count
        metrics["fedge-uplink-bytes"] = sum(map(len, secure.uploads.values())) + secure.uplink if secure else 0
        if self.dp is not None:
            metrics.update(self.dp.metrics())
        return aggregated, metrics

    def _take(self, server_round: int, secure: SecureRound, replies: list[Message]) -> None:
        """Each masked upload that is what the plan expects into ``secure``; the others refused, with why."""
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                self._refuse(server_round, node, f"client error {reply.error.code}: {reply.error.reason}")
                continue
            try:
                metrics = next(iter(reply.content.metric_records.values()), MetricRecord())
                secure.take(node, metrics, read_payload(reply.content, UPDATE_RECORD))
            except (ProtocolError, KeyError, ValueError) as error:
                self._refuse(server_round, node, str(error))

    def _note(self, server_round: int, secure: SecureRound) -> None:
        """The nodes the protocol dropped this round, each once in :attr:`refused`."""
        noted = {n for r, n, _ in self.refused if r == server_round}
        self.refused += [(server_round, f.node, f.reason) for f in secure.dropped() if f.node not in noted]

    def _refuse(self, server_round: int, node: int, reason: str) -> None:
        log.warning("round %d: reply from node %d refused: %s", server_round, node, reason)
        self.refused.append((server_round, node, reason))

    def describe(self) -> str:
        return f"secure aggregation: {self.spec.spec}"


@dataclass
class _Round:
    """What the wrapper sent in one round: the protocol's state (None: nothing could be sent), the
    model, the grid, and (under DP) the connected nodes the sample was drawn from."""

    number: int
    secure: SecureRound | None
    layout: Layout
    arrays: ArrayRecord
    grid: Grid
    connected: int
    #: the nodes planned into the secure round (under DP each adds 1/planned of the noise)
    planned: int = 0


def secure(strategy: Strategy, secure_aggregation: str = "secagg:bits=8,clip=0.2,weight-cap=256",
           seed: int = 0, differential_privacy: str = "none") -> SecureStrategy:
    """Wrap ``strategy`` so it aggregates only the sum of the round's updates (the ClientApp needs
    :func:`fedge.edge_client.secure_mod`). ``secure_aggregation`` is Fedge's spec (docs/settings.md,
    ``secure-aggregation``): ring bits, clip, weight cap, neighbours, threshold, stage timeout.
    ``differential_privacy="gaussian:noise=z,clip=C,..."``: distributed DP, the devices add the noise
    inside the ring (``fedge.flower.secure_dp``); nodes are Poisson-sampled at the strategy's
    ``fraction_train``."""
    return SecureStrategy(strategy, secure_aggregation, seed, differential_privacy)


def distributed_dp(strategy: Strategy, differential_privacy: str) -> SecureStrategy:
    """Distributed DP as a wrapper of its own: ``distributed_dp(secure(FedAvg(...)), "gaussian:noise=z,
    clip=C,...")`` is ``secure(FedAvg(...), differential_privacy=...)``. The devices add the noise
    inside secure aggregation's ring, so only a ``secure(...)`` can carry it; anything else is
    refused here, with the reason."""
    if not isinstance(strategy, SecureStrategy):
        raise ValueError(f"distributed DP adds its noise inside secure aggregation's ring: wrap secure(...) first, "
                         f"distributed_dp(secure({type(strategy).__name__}(...)), ...); for central DP use Flower's "
                         "DifferentialPrivacyServerSideFixedClipping")
    if strategy.dp is not None:
        raise ValueError("this secure(...) already carries distributed DP")
    return SecureStrategy(strategy.strategy, strategy.spec.spec, strategy.seed, differential_privacy)
