"""An in-process stand-in for Flower's ``Grid``, for fast unit tests of the round engine only.

It delivers each pushed message to the real Fedge ``ClientApp`` (the same handlers and mods the
engines run) with one ``Context`` per node, synchronously, and keeps the reply until it is pulled.
Runs for users always go through Flower's simulation or deployment engine; the integration tests
do that. Time is simulated: ``sleep`` advances ``clock``, so a round timeout costs no real seconds.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from flwr.app import Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedge.protocol.roster import ROSTER_MESSAGE_TYPE

__all__ = ["FakeClock", "InProcessGrid"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


class InProcessGrid:
    def __init__(
        self,
        num_nodes: int,
        *,
        app: Callable[[Message, Context], Message] | None = None,
        silent: set[int] | None = None,
        node_config: dict[int, dict[str, object]] | None = None,
        first_node_id: int = 1001,
        lag: dict[int, int] | None = None,
        run_config: dict[str, object] | None = None,
    ) -> None:
        # What Flower's ServerApp runtime sets before ``main``: messages built outside it need it.
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
        if app is None:
            from fedge.edge_client.app import app as fedge_app

            app = fedge_app
        self.app = app
        self.silent = silent or set()  # partition ids that never answer
        # partition id -> pulls a reply stays invisible for: a straggler, for the asynchronous engine
        self.lag = lag or {}
        self._hidden: dict[str, int] = {}
        self.contexts: dict[int, Context] = {}
        for i in range(num_nodes):
            config = {"partition-id": i, "num-partitions": num_nodes, **(node_config or {}).get(i, {})}
            self.contexts[first_node_id + i] = Context(run_id=1, node_id=first_node_id + i, node_config=config,
                                                       state=RecordDict(), run_config=dict(run_config or {}))
        self.replies: dict[str, Message] = {}
        self.pushed: list[Message] = []  # the run's work: every message but the roll call's
        self.roll_calls: list[Message] = []  # the coordinator asking nodes their names (protocol.roster)

    def node_id(self, partition: int) -> int:
        return sorted(self.contexts)[partition]

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            (self.roll_calls if msg.metadata.message_type == ROSTER_MESSAGE_TYPE else self.pushed).append(msg)
            context = self.contexts.get(msg.metadata.dst_node_id)
            ids.append(msg.metadata.message_id)
            if context is None or context.node_config["partition-id"] in self.silent:
                continue
            try:
                reply = self.app(msg, context)
            except Exception as err:  # what Flower's runtime does with a handler's exception
                reply = Message(Error(code=2, reason=f"{type(err).__name__}: {err}"), reply_to=msg)
            self.replies[msg.metadata.message_id] = reply
            self._hidden[msg.metadata.message_id] = self.lag.get(int(context.node_config["partition-id"]), 0)
        return ids

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        out = []
        for mid in list(message_ids):
            if mid not in self.replies:
                continue
            if self._hidden.get(mid, 0) > 0:
                self._hidden[mid] -= 1
                continue
            out.append(self.replies.pop(mid))
        return out
