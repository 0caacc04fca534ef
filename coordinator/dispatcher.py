"""Push messages and pull their replies as they arrive, over Flower's ``Grid``.

Flower's strategies call ``grid.send_and_receive``, which returns only when every reply is in (or
the timeout passed) and holds them all. The dispatcher keeps a set of messages in flight and yields
each reply the moment it is pulled, so the caller can decode it into an accumulator and drop it.
``push`` may be called again while replies are being drained: a synchronous round is "push, then
drain until done or timeout"; an asynchronous algorithm keeps clients busy by pushing a new message
as each reply lands.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from flwr.app import Message

from fedge.coordinator.step import Missing

if TYPE_CHECKING:
    from fedge.coordinator.step import Exchange, Outgoing

__all__ = ["Dispatcher", "grid_exchange", "step_messages"]

log = logging.getLogger(__name__)

_POLL_START, _POLL_MAX = 0.05, 1.0  # seconds between pulls: quick in simulation, gentle when deployed


class Dispatcher:
    def __init__(
        self,
        grid: object,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.grid = grid
        self.clock = clock
        self.sleep = sleep
        self._pending: dict[str, tuple[int, float, float]] = {}  # message id -> (node, deadline, timeout)
        self._missing: list[Missing] = []
        #: replies of the current pull not yet yielded: an asynchronous caller refills its free
        #: slots once a pull's replies are all in, so simultaneous replies start from one version
        self.batch_left = 0

    def push(self, messages: list[Message], timeout: float) -> None:
        """Send ``messages``; each must be answered within ``timeout`` seconds from now."""
        if not messages:
            return
        returned = list(self.grid.push_messages(messages))  # type: ignore[attr-defined]
        accepted = {str(mid) for mid in returned if mid}
        deadline = self.clock() + timeout
        for message in messages:
            mid = message.metadata.message_id
            node = message.metadata.dst_node_id
            if mid and mid in accepted:
                self._pending[mid] = (node, deadline, timeout)
            else:
                self._missing.append(Missing(node, "the SuperLink did not accept the message"))

    def replies(self) -> Iterator[Message | Missing]:
        """Yield replies as they arrive, and a :class:`Missing` for each message whose deadline
        passed (or that the SuperLink refused), until nothing is in flight."""
        pause = _POLL_START
        while self._pending or self._missing:
            while self._missing:
                yield self._missing.pop(0)
            if not self._pending:
                break
            got = list(self.grid.pull_messages(list(self._pending)))  # type: ignore[attr-defined]
            mine = [r for r in got if r.metadata.reply_to_message_id in self._pending]
            self.batch_left = len(mine)
            for reply in mine:
                self._pending.pop(reply.metadata.reply_to_message_id, None)
                self.batch_left -= 1
                yield reply
            now = self.clock()
            for mid, (node, deadline, timeout) in list(self._pending.items()):
                if now >= deadline:
                    del self._pending[mid]
                    yield Missing(node, f"no reply within {timeout:g} s")
            if self._pending and not got:
                nearest = min(deadline for _, deadline, _ in self._pending.values())
                self.sleep(max(0.0, min(pause, nearest - self.clock())))
                pause = min(pause * 2, _POLL_MAX)
            elif got:
                pause = _POLL_START

    def exchange(self, messages: list[Message], timeout: float) -> Iterable[Message | Missing]:
        """Synchronous step: push ``messages`` and drain every reply or timeout."""
        self.push(messages, timeout)
        return self.replies()


def step_messages(outgoing: list[Outgoing], number: int, group: str,
                  ttl: float | None = None) -> list[Message]:
    """The Flower messages of step ``number``'s ``outgoing`` (group ``<number>-<group>``; ``ttl``:
    seconds, None: Flower's default)."""
    lifetime = {} if ttl is None else {"ttl": ttl}
    return [Message(o.content, dst_node_id=o.node, message_type=o.message_type, group_id=f"{number}-{group}",
                    **lifetime) for o in outgoing]


def grid_exchange(grid: object, number: int, *, ttl: float | None = None,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> Exchange:
    """Step ``number``'s exchanges with its devices over ``grid`` (its train messages, secure
    aggregation's key agreement and unmasking, federated evaluation), as every driver runs them:
    each reply as it lands, a :class:`Missing` for a node that did not answer in time."""

    def exchange(outgoing: list[Outgoing], timeout: float, group: str) -> Iterable[Message | Missing]:
        if not outgoing:
            return iter(())
        messages = step_messages(outgoing, number, group, ttl)
        return Dispatcher(grid, clock=clock, sleep=sleep).exchange(messages, timeout)

    return exchange
