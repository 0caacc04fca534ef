"""The asynchronous schedule both coordinators run: keep ``concurrency`` nodes training at all times.

FedBuff and FedAsync never wait for a round's slowest node. Each node gets a message as soon as it
is free; each reply is handed over the moment it is pulled, with the version its message started
from, and the freed node gets the next message once the replies of that pull are all in (so the
replies that land together start their next work from the same version). This schedule was
written twice, once in Fedge's engine and once in ``fedge.flower.FedBuff``; it now lives here, and
the two are thin callers: what a message holds, which free nodes get it and what a reply does to
the model stay theirs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Message

from fedge.coordinator.dispatcher import Dispatcher, step_messages
from fedge.coordinator.step import Missing, Outgoing

__all__ = ["AsyncLoop"]


class AsyncLoop:
    """``busy`` maps each node with a message in flight to the version that message started from;
    ``dispatches`` counts the fills that sent messages (each names its messages' group)."""

    def __init__(self, grid: object, concurrency: int, reply_timeout: float, *, ttl: float | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.grid, self.dispatcher = grid, Dispatcher(grid, clock=clock, sleep=sleep)
        self.concurrency, self.reply_timeout, self.ttl = int(concurrency), float(reply_timeout), ttl
        self.busy: dict[int, int] = {}
        self.dispatches = 0

    def fill(self, version: int, pick: Callable[[list[int], int, int], list[int]],
             send: Callable[[list[int]], list[Outgoing]]) -> None:
        """Give the free slots to free nodes: ``pick(free, wanted, dispatch)`` chooses among the
        connected nodes without a message (in the grid's order), ``send(nodes)`` builds what goes
        to them (a layer may keep some back); they go out as step ``version + 1``'s messages."""
        free = [n for n in self.grid.get_node_ids() if n not in self.busy]  # type: ignore[attr-defined]
        wanted = min(self.concurrency - len(self.busy), len(free))
        if wanted <= 0:
            return
        dispatch, self.dispatches = self.dispatches, self.dispatches + 1
        outgoing = send(pick(free, wanted, dispatch))
        messages = step_messages(outgoing, version + 1, f"v{version}-d{dispatch}", self.ttl)
        self.dispatcher.push(messages, self.reply_timeout)
        self.busy.update({m.metadata.dst_node_id: version for m in messages})

    def run(self, *, done: Callable[[], bool], fill: Callable[[], object],
            receive: Callable[[int, int | None, Message | Missing], bool], wait: Callable[[], None]) -> None:
        """Until ``done()``: fill the free slots, hand each reply (or :class:`Missing`) to
        ``receive(node, started, item)``, which returns True to stop at once (the last version is
        out: messages still in flight would train a finished model), and refill after each pull.
        ``wait()`` runs while no node is busy (none connected yet)."""
        while not done():
            fill()
            if not self.busy:
                wait()
                continue
            for item in self.dispatcher.replies():
                node = item.node if isinstance(item, Missing) else item.metadata.src_node_id
                if receive(node, self.busy.pop(node, None), item):
                    return
                if not self.dispatcher.batch_left:
                    fill()
