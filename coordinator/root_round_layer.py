"""A leaf's layer: on every train message of a step, the root round the step serves and the leaf.

``fedge.edge_client.counted_once`` reads them: a device that moved between leaves during a root
round takes part in it once. The leaf coordinator (``fedge.server.leaf``) sets :attr:`current`
before each step its root asks for.
"""

from __future__ import annotations

from fedge.coordinator.layer import Layer
from fedge.coordinator.step import Outgoing, Step
from fedge.protocol import CONFIG_RECORD
from fedge.protocol.config_keys import ROOT_LEAF, ROOT_ROUND

__all__ = ["RootRoundStamp"]


class RootRoundStamp(Layer):
    """The leaf's layer that names, on every train message of a step, the root round the step
    serves and this leaf (``fedge.edge_client.counted_once``: a device that moved between leaves
    during a root round takes part in it once)."""

    key = "root-round"

    def __init__(self) -> None:
        self.current: tuple[str, int] | None = None  # ("<root run>/<round>", leaf) of the step running

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        if self.current is None:
            return
        for o in outgoing:
            config = o.content.config_records[CONFIG_RECORD]
            config[ROOT_ROUND], config[ROOT_LEAF] = self.current
