"""The public parameters of one secure-aggregation round, fixed by the coordinator before it starts.

Everything a device needs to take part and everything the coordinator needs to unmask is here:
who takes part, who neighbours whom, the shared grid, and the ring width, sized for the number of
participants so the sum cannot wrap. A device checks the plan it receives (``validate``) before it
spends any work on it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fedge.privacy.distributed_dp import SkellamParams
from fedge.privacy.errors import ProtocolError, RingError
from fedge.privacy.keys import RoundContext
from fedge.privacy.neighbourhood import auto_neighbours, default_threshold, harary_neighbours
from fedge.privacy.ring import ring_bits
from fedge.privacy.shared_grid import SharedGrid

__all__ = ["SecAggPlan"]


@dataclass(frozen=True)
class SecAggPlan:
    """One round's parameters. ``neighbours``/``threshold`` 0 mean the defaults for the round's size."""

    context: RoundContext
    participants: tuple[int, ...]
    grid: SharedGrid
    dimension: int
    graph_seed: int
    neighbours: int = 0
    threshold: int = 0
    headroom_bits: int = 0
    #: random-k with a shared support: the model's full length (0: dense, every coordinate is
    #: summed) and the public seed every device draws the same ``dimension`` coordinates from
    model_size: int = 0
    support_seed: int = 0
    #: a coordinator that may lie (``secagg:issuer=...``): identities must be issued by the
    #: operator, and devices sign the survivor set and check a quorum of signatures before unmasking
    consistency: bool = False
    #: distributed DP: each device adds Skellam noise to its clipped, scaled, rounded update before
    #: masking (``fedge.privacy.distributed_dp``); the ring then holds signed values plus the noise
    noise: SkellamParams | None = None

    def __post_init__(self) -> None:
        if len(set(self.participants)) != len(self.participants):
            raise ProtocolError("a device appears twice in the round")
        if len(self.participants) < 2:
            raise ProtocolError("secure aggregation needs at least two devices")
        if self.dimension < 1:
            raise ProtocolError(f"the update dimension must be positive, got {self.dimension}")
        degree = self.degree  # the graph's real largest degree
        if not 1 <= self.reconstruction_threshold <= degree:
            raise ProtocolError(f"threshold {self.reconstruction_threshold} must be in [1, {degree}]")
        if 2 * self.reconstruction_threshold <= degree:
            raise ProtocolError(f"threshold {self.reconstruction_threshold} of {degree} neighbours is not a "
                                "majority: a coordinator could collect both a device's seed and key shares")
        if self.consistency and 3 * self.reconstruction_threshold <= 2 * degree:
            raise ProtocolError(f"threshold {self.reconstruction_threshold} of {degree} neighbours is not above "
                                "two thirds: against a coordinator that may lie, two colluding neighbours would "
                                "let it collect both kinds of a device's shares by equivocation")
        if self.model_size and self.model_size < self.dimension:
            raise ProtocolError(f"a support of {self.dimension} coordinates out of {self.model_size} is impossible")
        if self.noise is not None and (self.noise.dimension != self.dimension or self.model_size):
            raise ProtocolError("distributed noise covers the whole update: its dimension must be the plan's, "
                                "without random-k")
        self.bits  # sizes the ring now: a plan that cannot hold its sum is refused here

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 of every public parameter: signed into each advertisement and kept with a device's
        round state, so no stage can run under another plan than the one the device advertised for
        (another threshold, participant list or ring width mid-round is refused)."""
        words = [self.context.round, len(self.participants), *self.participants, self.grid.bits,
                 self.grid.weight_cap, self.dimension, self.graph_seed, self.neighbours, self.threshold,
                 self.headroom_bits, self.model_size, self.support_seed, int(self.consistency)]
        packed = struct.pack(f"<{len(words)}Q", *words) + struct.pack("<d", self.grid.clip)
        if self.noise is not None:
            packed += struct.pack("<3dQ", self.noise.clip, self.noise.scale, self.noise.local_variance,
                                  self.noise.dimension)
        return hashlib.sha256(b"fedge-secagg-plan|" + self.context.run_id + b"|" + packed).digest()

    @property
    def consistency_quorum(self) -> int:
        """Signatures over one survivor set a device needs before it unmasks: more than two thirds of
        the round's participants (Bonawitz et al. 2017, active adversary). An honest device signs one
        set per round, so two sets both gather a quorum only if more than n/3 devices sign both: a
        strict majority fell to two colluders of six (privacy audit 2, N3)."""
        return 2 * len(self.participants) // 3 + 1

    @property
    def configured_degree(self) -> int:
        """The neighbour count asked for (``neighbours``, or the automatic one), capped at n - 1."""
        return min(self.neighbours or auto_neighbours(len(self.participants)), len(self.participants) - 1)

    @cached_property
    def degree(self) -> int:
        """The largest number of neighbours any device has in the round's graph: what the threshold
        must be a strict majority of. With an odd configured degree and an odd number of devices no
        regular graph exists and H(k, n) links devices to two "opposite" ones (degree k + 1): a
        threshold taken from k would then be exactly half of a device's neighbours, and a
        coordinator could collect its seed shares from one half and its key shares from the other."""
        return max(len(peers) for peers in self.graph.values())

    @property
    def reconstruction_threshold(self) -> int:
        return self.threshold or default_threshold(self.degree, active=self.consistency)

    @property
    def bits(self) -> int:
        """Ring width: the grid's levels summed over every participant, plus the headroom; with
        distributed noise, every participant's signed bound plus the summed noise's tail bound."""
        if self.noise is not None:
            return self.noise.ring_bits(len(self.participants))
        return ring_bits(self.grid.bits, len(self.participants), self.headroom_bits)

    @property
    def length(self) -> int:
        """Coordinates of a masked upload: the update plus the weight's digits (none under
        distributed DP: every device weighs 1)."""
        if self.noise is not None:
            return self.dimension
        return self.dimension + self.grid.weight_digits

    @cached_property
    def support(self) -> np.ndarray | None:
        """The coordinates every device sends this round (sorted), or None when all of them are sent.

        Random-k with one support for everyone keeps the masked vectors aligned: the sum of the
        devices' k values is the sum of their updates on those k coordinates (Konečný et al. 2016's
        random mask, shared). What a device does not send stays in its error-feedback residual."""
        if not self.model_size or self.model_size == self.dimension:
            return None
        rng = np.random.default_rng(self.support_seed)
        return np.sort(rng.choice(self.model_size, size=self.dimension, replace=False))

    @cached_property
    def graph(self) -> dict[int, tuple[int, ...]]:
        return harary_neighbours(self.participants, self.configured_degree, self.graph_seed)

    def neighbours_of(self, node: int) -> tuple[int, ...]:
        try:
            return self.graph[node]
        except KeyError:
            raise ProtocolError(f"device {node} is not a participant of this round") from None

    def holder_index(self, dealer: int, holder: int) -> int:
        """The Shamir index (from 1) of ``holder``'s share of ``dealer``'s secrets."""
        peers = self.neighbours_of(dealer)
        try:
            return peers.index(holder) + 1
        except ValueError:
            raise ProtocolError(f"device {holder} is not a neighbour of device {dealer}") from None

    def check_capacity(self, summands: int) -> None:
        if summands > len(self.participants):
            raise RingError(f"{summands} summands in a ring sized for {len(self.participants)}")
