"""Decentralized learning by compressed gossip: ``algorithm = "gossip[:topology=ring,gamma=1,measure=1]"``.

There is no global model. Every node keeps its own model x_i and mixes it with its neighbours'
along a topology (``aggregation.topology``: ring, 2-D torus, static exponential graph, one-peer
time-varying exponential graph, random d-regular), exchanging compressed messages with
CHOCO-SGD (Koloskova, Stich, Jaggi, ICML 2019, https://arxiv.org/abs/1902.00340; the math is in
``aggregation.choco``). Flower has no peer-to-peer channel, so the coordinator **relays**: it
collects each node's q_i = Q(x_i − x̂_i) and hands it, still encoded, to the nodes that hold a copy
of x̂_i in the next message. It never averages models.

One step t, for node i (position i of the topology):

1. the message carries the neighbours' (and its own) q's of step t−1 and the mixing weights W(t−1)
   row i; the node applies them to its public copies and does the consensus step
   x_i ← x_i + γ Σ_j W_ij (x̂_j − x̂_i) (CHOCO's exchange, deferred to the next message);
2. the node trains locally for the round's local epochs and replies q_i = Q(x_i − x̂_i).

Consistency: every copy is versioned by step. The coordinator applies each accepted q to its own
copy x̂_i the same way the nodes do, and remembers which version each node holds; a node not known
to hold the previous version (it missed a step, joined late, or the coordinator restarted) gets
its copies in full instead of the q's. A q the coordinator rejects is relayed to no one, so the
node and its peers skip it together. Public copies therefore agree bit for bit everywhere.

The consensus step size γ defaults to 1 (full mixing): on digits with 16 nodes and an exponential
graph it gave 96.1% against 95.3% at γ = 0.5, with 4-bit QSGD as with fp32. CHOCO's analysis asks
for a smaller γ as the codec gets coarser: for 1-bit-class codecs (``sign``) use γ = 0.5.

Measurement: every ``measure`` steps (and at the last one) nodes also upload their exact model
(``measure`` record, counted as ``measurement_bytes``, not as training traffic). From those the
coordinator computes, streaming, the consensus distance Ξ² = (1/n) Σ ‖x_i − x̄‖², each node model's
held-out accuracy (mean and worst) and the average model x̄, which is the row's ``accuracy`` and the
run's final model.

Coordinator memory per node, stated honestly: one public copy x̂_i (4·d bytes; needed to resync a
node and to resume), the last encoded q_i (its payload size) and the version the node holds; plus,
during a measuring step, O(d) float64 accumulators for the whole run. For the digits CNN (d = 38,282)
at 16 nodes that is 16 × 153 KB of copies.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, RecordDict

from fedge.aggregation.exact_sum import ExactScalar, ExactSum
from fedge.aggregation.topology import Topology, make_topology
from fedge.compression import relative_error
from fedge.protocol.config_keys import (
    GOSSIP_GAMMA,
    GOSSIP_MEASURE,
    GOSSIP_MIX_PEERS,
    GOSSIP_MIX_WEIGHTS,
    GOSSIP_PEERS,
    GOSSIP_POSITION,
    GOSSIP_VERSION,
)
from fedge.protocol import (
    CONFIG_RECORD,
    MEASURE_RECORD,
    PUBLIC_RECORD,
    RELAY_RECORD,
    flat_array,
    payload_array,
    read_flat,
)
from fedge.server.engine.algorithm import Algorithm, Outgoing, Rejected, Reply, RunContext, Step, StepOutcome, Update

__all__ = ["Gossip"]

log = logging.getLogger(__name__)

_TOPOLOGIES = ("ring", "torus", "exponential", "onepeer", "random")


@dataclass
class GossipStep(Step):
    """One gossip step: the payloads to relay next step, who replied, and the measured models."""

    next_pending: list[bytes | None] = field(default_factory=list)
    replied: set[int] = field(default_factory=set)
    # exact sums: the row and the average model are the same whatever order the replies came in
    loss: ExactScalar = field(default_factory=ExactScalar)
    measured: int = 0
    measured_sum: ExactSum | None = None
    measured_sumsq: ExactScalar = field(default_factory=ExactScalar)
    scores: list[float] = field(default_factory=list)  # each measured node's model, primary metric


class Gossip(Algorithm):
    name = "gossip"
    weighted = False  # mixing weights come from the topology, not from example counts
    fixed_membership = True  # the topology's nodes take part in every step: nothing is sampled
    relays_updates = True  # each accepted payload goes to the node's peers exactly as it was sent

    def __init__(self, ctx: RunContext, topology: str = "ring", gamma: float = 1.0, degree: int = 4,
                 measure: int = 1) -> None:
        super().__init__(ctx)
        if topology not in _TOPOLOGIES:
            raise ValueError(f"unknown gossip topology {topology!r}; available: {', '.join(_TOPOLOGIES)}")
        if not 0 < gamma <= 1:
            raise ValueError(f"gossip gamma must be in (0, 1], got {gamma}")
        if measure < 1:
            raise ValueError(f"gossip measure must be >= 1 (every K steps), got {measure}")
        self.n = ctx.settings.clients_per_round
        if self.n < 2:
            raise ValueError("gossip needs clients-per-round >= 2 (the number of nodes in the topology)")
        noise = relative_error(ctx.codec, ctx.numel)
        if noise > 0.2 and gamma > 0.5:
            log.warning("codec %s has relative squared error %.2f: CHOCO may diverge at gamma %g; use gamma <= 0.5",
                        ctx.codec.spec, noise, gamma)
        topo_spec = f"random:degree={degree}" if topology == "random" else topology
        self.topology: Topology = make_topology(topo_spec, self.n, seed=ctx.settings.seed)
        self.topology_name, self.gamma, self.degree, self.measure = topology, float(gamma), int(degree), int(measure)
        self.holders = {i: self.topology.peers(i) + [i] for i in range(self.n)}  # copies node i keeps
        self.public: list[torch.Tensor] = []
        self.pending: list[bytes | None] = [None] * self.n
        self.synced: dict[int, int] = {}  # position -> version of the copies it holds
        self.average: torch.Tensor | None = None
        self._members: list[int] | None = None  # node ids by position (fixed while the run lives)
        log.info("gossip topology %s over %d nodes: spectral gap %.4f%s", self.topology.spec, self.n,
                 self.topology.spectral_gap(), " per period" if self.topology.period > 1 else "")

    @property
    def spec(self) -> str:
        degree = f",degree={self.degree}" if self.topology_name == "random" else ""
        return f"gossip:topology={self.topology_name},gamma={self.gamma:g}{degree},measure={self.measure}"

    def start(self, params: torch.Tensor) -> None:
        x0 = params.clone().to(torch.float32)
        self.public = [x0.clone() for _ in range(self.n)]
        self.average = x0.clone()

    def nodes_needed(self) -> int:
        return self.n

    def select(self, step: int, nodes: list[int], sample: Any) -> list[int]:
        """The topology's members (fixed membership: the engine has waited until ``n`` nodes are
        connected, and never samples). Positions follow the run's canonical order of the nodes (by
        partition, ``fedge.server.engine.roster``: the same partitions take the same positions in
        every run of a seed); a resumed run (new Flower run, new node state) re-maps them and every
        node receives its copies in full."""
        if self._members is None:
            self._members = list(nodes)[: self.n]
        return list(self._members)

    @property
    def _position(self) -> dict[int, int]:
        return {node: i for i, node in enumerate(self._members or [])}

    def _measuring(self, step: int) -> bool:
        return step % self.measure == 0 or step == self.ctx.settings.rounds

    def open_step(self, number: int, nodes: list[int]) -> GossipStep:
        return GossipStep(number, list(nodes), next_pending=[None] * self.n,
                          measured_sum=ExactSum(self.ctx.numel))

    def configure(self, step: Step, nodes: list[int]) -> list[Outgoing]:
        version = step.number - 1  # the copies each node holds after this message
        measuring = self._measuring(step.number)
        weights = self.topology.mixing(version) if version >= 1 else None
        position = self._position
        out = []
        for node in nodes:
            i = position[node]
            peers = self.holders[i]
            mix = {j: float(weights[i, j]) for j in peers if j != i} if weights is not None else {}
            # relayed payloads were encoded in step ``version`` with the run's codec for that round:
            # the device derives it from the config's codec, as for its own upload (one convention)
            extra: dict[str, Any] = {
                GOSSIP_POSITION: i, GOSSIP_VERSION: version, GOSSIP_GAMMA: self.gamma, GOSSIP_MEASURE: measuring,
                GOSSIP_PEERS: peers, GOSSIP_MIX_PEERS: list(mix), GOSSIP_MIX_WEIGHTS: list(mix.values()),
            }
            content = RecordDict({CONFIG_RECORD: self.round_config(step.number, **extra).to_record()})
            if self.synced.get(i) == version - 1 and version >= 1:
                relay = {str(j): payload_array(self.pending[j]) for j in peers if self.pending[j] is not None}
                content[RELAY_RECORD] = ArrayRecord(relay) if relay else ArrayRecord()
            else:
                content[PUBLIC_RECORD] = ArrayRecord({str(j): flat_array(self.public[j]) for j in peers})
            out.append(Outgoing(node, content, self.message_type))
        return out

    def admit(self, step: Step, reply: Reply) -> None:
        if reply.node not in self._position:
            raise Rejected(f"node {reply.node} is not part of the gossip topology")
        if self._measuring(step.number) and (
                MEASURE_RECORD not in reply.content.array_records
                or "model" not in reply.content.array_records[MEASURE_RECORD]):
            raise Rejected("a measuring step's reply has no measure record")

    def absorb(self, step: Step, update: Update) -> None:
        # The bytes are relayed as sent (``relays_updates``): the update guard may only refuse them.
        assert isinstance(step, GossipStep) and step.measured_sum is not None
        i = self._position[update.node]
        measured = None
        if self._measuring(step.number):
            measured = read_flat(update.content.array_records[MEASURE_RECORD]["model"], self.ctx.numel,
                                 f"{MEASURE_RECORD}[model]")
        new_public = self.public[i] + update.vector
        if not bool(torch.isfinite(new_public).all()):
            raise Rejected("the update would make the public copy non-finite")
        self.public[i] = new_public
        step.next_pending[i] = update.payload
        step.replied.add(i)
        step.loss.add(update.train_loss)
        if measured is not None:
            wide = measured.to(torch.float64)
            step.measured_sum.add(measured)
            step.measured_sumsq.add(float(wide.dot(wide)))
            step.measured += 1
            if self.ctx.central_data is not None:  # each node's own model on central held-out data
                step.scores.append(self.ctx.evaluate(measured)[self.ctx.task.primary_metric])

    def missed(self, step: Step, node: int, reason: str) -> None:
        """A node without a usable reply holds no known version: it gets its copies in full next."""
        position = self._position.get(node)
        if position is not None:
            self.synced.pop(position, None)

    def close(self, step: Step) -> StepOutcome:
        assert isinstance(step, GossipStep) and step.measured_sum is not None
        version = step.number - 1
        for i in step.replied:  # a node that missed the step was forgotten by missed()
            self.synced[i] = version
        self.pending = step.next_pending
        extra: dict[str, Any] = {"topology": self.topology.spec, "spectral_gap": self.topology.spectral_gap(),
                                 "nodes_replied": len(step.replied), "measured": step.measured > 0}
        if step.measured:
            mean = step.measured_sum.value(torch.float64, scale=1.0 / step.measured)
            xi2 = max(0.0, step.measured_sumsq.value / step.measured - float(mean.dot(mean)))
            self.average = mean.to(torch.float32)
            extra.update({"consensus_distance": xi2, "nodes_measured": step.measured})
            scores, task = step.scores, self.ctx.task
            if scores:  # e.g. node_accuracy_mean / node_accuracy_worst, node_mse_mean / node_mse_worst
                extra[f"node_{task.primary_metric}_mean"] = math.fsum(scores) / len(scores)
                extra[f"node_{task.primary_metric}_worst"] = min(scores) if task.maximize else max(scores)
        loss = step.loss.value / step.loss.count if step.loss.count else None
        return StepOutcome(model=self.average, train_loss=loss, extra=extra)

    def final_model(self) -> torch.Tensor:
        assert self.average is not None
        return self.average.clone()

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.spec, "topology": self.topology.describe(), "gamma": self.gamma,
                "copies_per_node": {str(i): len(h) for i, h in self.holders.items()},
                "coordinator_bytes_per_node": 4 * self.ctx.numel}

    def state_dict(self) -> dict[str, Any]:
        return {
            "public": torch.stack(self.public),
            "pending": [torch.frombuffer(bytearray(p), dtype=torch.uint8) if p is not None else torch.zeros(0, dtype=torch.uint8)
                        for p in self.pending],
            "average": self.average.clone() if self.average is not None else torch.zeros(0),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        public = state.get("public")
        if not isinstance(public, torch.Tensor) or tuple(public.shape) != (self.n, self.ctx.numel):
            raise ValueError(f"gossip public copies must be a {self.n} x {self.ctx.numel} tensor")
        self.public = [self.check_flat(row, f"public copy {i}") for i, row in enumerate(public)]
        self.average = self.check_flat(state.get("average"), "average model")
        # The pending q's were addressed to nodes of the crashed run, whose state is gone: after a
        # restart every node gets its copies in full, so they are not relayed (but stay valid).
        pending = state.get("pending")
        if not isinstance(pending, list) or len(pending) != self.n:
            raise ValueError("gossip pending payloads do not match the topology")
        self.pending = [None] * self.n
        self.synced = {}
        self._members = None
