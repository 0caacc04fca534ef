"""Which device a simulated leaf's node is: the mapping a simulated leaf's nodes share with a
deployed leaf's SuperNodes.

Beyond one SuperLink, the launcher splits N devices over L leaves by partition: leaf ``I`` holds the
devices of partitions ``I, I + L, I + 2L, ...`` of N (``fedge.server.local``). A deployed leaf gives
each of its SuperNodes that partition in its node config. A leaf whose devices are simulated by
Flower's Simulation Engine cannot: Flower numbers its simulated nodes 0..n-1 of n
(``partition-id`` / ``num-partitions``). The run setting ``leaf-devices = "I/L/N"`` says which leaf
this is, and :meth:`LeafDevices.device` turns a simulated node's partition ``j`` into the device's
partition of N, so that the same device trains on the same data, with the same seeds, whichever way
its leaf runs. Kept free of torch and Flower: the settings check it before any process starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LeafDevices", "LeafDevicesError", "parse_leaf_devices"]

_FORM = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*/\s*(\d+)\s*$")


class LeafDevicesError(ValueError):
    """A ``leaf-devices`` value that names no leaf of a federation: says what is wrong."""


@dataclass(frozen=True)
class LeafDevices:
    """Leaf ``index`` of ``leaves`` over ``devices`` devices."""

    index: int
    leaves: int
    devices: int

    @property
    def nodes(self) -> int:
        """How many of the devices this leaf holds (its simulated nodes)."""
        return len(range(self.index, self.devices, self.leaves))

    def device(self, node: int) -> int:
        """The partition of N of this leaf's simulated node ``node`` (0..nodes-1)."""
        if not 0 <= node < self.nodes:
            raise LeafDevicesError(f"leaf {self.index} of {self.leaves} holds {self.nodes} of the {self.devices} "
                                   f"devices; it has no node {node}")
        return self.index + node * self.leaves

    @property
    def spec(self) -> str:
        return f"{self.index}/{self.leaves}/{self.devices}"


def parse_leaf_devices(spec: str) -> LeafDevices:
    """``"I/L/N"`` -> :class:`LeafDevices`; a clear :class:`LeafDevicesError` for anything else."""
    match = _FORM.match(str(spec))
    if match is None:
        raise LeafDevicesError(f"leaf-devices must be 'I/L/N' (leaf I of L over N devices), got {spec!r}")
    index, leaves, devices = (int(g) for g in match.groups())
    if not 0 <= index < leaves:
        raise LeafDevicesError(f"leaf-devices {spec!r}: leaf {index} is not one of 0..{leaves - 1}")
    if devices < leaves:
        raise LeafDevicesError(f"leaf-devices {spec!r}: {devices} devices cannot fill {leaves} leaves")
    return LeafDevices(index, leaves, devices)
