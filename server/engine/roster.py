"""The coordinator's side of the roll call (``fedge.protocol.roster``): nodes in an order that
means the same devices in every run of one seed.

The engine asks each node it has not yet heard from for its stable name before it chooses among
nodes (once per node and run: a node keeps its name while it is connected), and hands every seeded
choice the nodes in :meth:`Roster.order`: named nodes by name, then the others by Flower's number.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from flwr.app import Message, RecordDict

from fedge.coordinator.step import Missing
from fedge.protocol.roster import ROSTER_MESSAGE_TYPE, read_roster_answer
from fedge.coordinator.step import Outgoing

__all__ = ["Roster"]

log = logging.getLogger(__name__)

Exchange = Callable[[list[Outgoing], float, str], Iterable[Message | Missing]]


class Roster:
    """Each node's stable name (None: it has none, or did not answer), learnt by asking once."""

    def __init__(self) -> None:
        self.names: dict[int, int | None] = {}

    def learn(self, nodes: Iterable[int], exchange: Exchange, timeout: float) -> None:
        """Ask the nodes not asked before; a node that does not answer in ``timeout`` stays unnamed."""
        new = sorted(set(nodes) - set(self.names))
        if not new:
            return
        asked = [Outgoing(node, RecordDict(), ROSTER_MESSAGE_TYPE) for node in new]
        for item in exchange(asked, timeout, "roster"):
            if isinstance(item, Missing):
                self.names[item.node] = None
                continue
            node = item.metadata.src_node_id
            self.names[node] = None if item.has_error() else read_roster_answer(item.content)
        for node in new:
            self.names.setdefault(node, None)
        unnamed = [n for n in new if self.names[n] is None]
        taken: dict[int, int] = {}
        for node in new:
            name = self.names[node]
            if name is not None and name in taken:
                log.warning("nodes %d and %d both answer to partition %d: their order follows Flower's "
                            "numbers", taken[name], node, name)
            elif name is not None:
                taken[name] = node
        log.info("roll call: %d of %d new node(s) named by partition%s", len(new) - len(unnamed), len(new),
                 f"; {len(unnamed)} keep Flower's number (no partition id or no answer)" if unnamed else "")

    def key(self, node: int) -> tuple[int, int, int]:
        """Sort key: named nodes by name first, then the rest by Flower's number."""
        name = self.names.get(node)
        return (0, name, node) if name is not None else (1, 0, node)

    def order(self, nodes: Iterable[int]) -> list[int]:
        """``nodes`` in the run's canonical order."""
        return sorted(nodes, key=self.key)

    def name(self, node: int) -> int | None:
        return self.names.get(node)
