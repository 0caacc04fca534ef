"""Who masks with whom: SecAgg+'s k-regular Harary graph over a random ordering of the devices.

Plain SecAgg pairs every device with every other (O(n^2) key agreements and masks per round);
Bell et al. (CCS'20) show that a k-regular graph with k = O(log n) keeps the sum private and
recoverable, at O(log n) cost per device. The graph is a Harary graph H(k, n) (each device linked to
the k/2 nearest on each side of a ring) over a permutation drawn from the round's public seed, so the
coordinator cannot place two devices as neighbours on purpose without the seed showing it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from fedge.privacy.errors import ProtocolError

__all__ = ["auto_neighbours", "default_threshold", "harary_neighbours", "max_colluders"]


def auto_neighbours(devices: int) -> int:
    """Degree used when none is configured: every other device up to 16 (plain SecAgg), then 4 ceil(log2 n).

    O(log n) as in SecAgg+; the constant is a choice for semi-honest coordinators with few dropouts
    (Bell et al.'s concrete parameters for 5% corrupt and 5% dropped devices are larger: set
    ``neighbours`` for a stronger threat model).
    """
    if devices <= 17:
        return devices - 1
    return min(devices - 1, 2 * math.ceil(2 * math.log2(devices)))


def default_threshold(neighbours: int, *, active: bool = False) -> int:
    """The Shamir threshold for a device with ``neighbours`` neighbours; up to ``neighbours -
    threshold`` of them may drop.

    Against a coordinator that is honest but curious, a strict majority: it can never hold both a
    device's seed shares and its key shares, since each honest neighbour reveals one kind. Against
    one that may lie (``active``, the consistency round), more than two thirds (Bonawitz et al.
    2017's active-adversary parameter): a coordinator that shows two groups different survivor
    sets collects one kind from each group, and colluding neighbours reveal both kinds, so it needs
    2t <= neighbours + colluders; with t > 2k/3 that takes more than k/3 colluders, not two (privacy
    audit 2, N3)."""
    return 2 * neighbours // 3 + 1 if active else neighbours // 2 + 1


def max_colluders(neighbours: int, threshold: int) -> int:
    """The most colluding neighbours of a device whose update a lying coordinator still cannot
    unmask by equivocation: it needs ``threshold`` seed shares and ``threshold`` key shares, each
    honest neighbour gives one kind and each colluder both, so c colluders suffice once
    ``neighbours + c >= 2 * threshold``."""
    return max(0, 2 * threshold - neighbours - 1)


def harary_neighbours(devices: Sequence[int], degree: int, seed: int) -> dict[int, tuple[int, ...]]:
    """Each device's neighbours (sorted) in H(degree, n) over a seeded permutation of ``devices``."""
    ordered = sorted(set(devices))
    n = len(ordered)
    if n != len(devices):
        raise ProtocolError("a device appears twice in the round")
    if n < 2:
        raise ProtocolError("secure aggregation needs at least two devices")
    if not 1 <= degree <= n - 1:
        raise ProtocolError(f"degree {degree} must be in [1, {n - 1}] for {n} devices")
    permuted = list(ordered)
    random.Random(seed).shuffle(permuted)
    links: dict[int, set[int]] = {node: set() for node in ordered}
    half = degree // 2
    for position, node in enumerate(permuted):
        for step in range(1, half + 1):
            peer = permuted[(position + step) % n]
            links[node].add(peer)
            links[peer].add(node)
    if degree % 2:  # odd degree: also link each device to the one opposite it on the ring
        for position, node in enumerate(permuted):
            peer = permuted[(position + n // 2) % n]
            if peer != node:
                links[node].add(peer)
                links[peer].add(node)
    return {node: tuple(sorted(peers)) for node, peers in links.items()}
