"""The ``faulty-clients`` run setting, read by the coordinator (validation) and the devices (the
fault-injection mod): ``none`` or ``fraction=F,fault=NAME``.

A SuperNode's own node config ``fault=NAME`` injects a fault on one device; this setting does it in
a simulation, whose virtual nodes share one node config: the *last* ⌈F × num-partitions⌉ partitions
misbehave (stragglers take the first ones, so the two can be combined without overlap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedge.compression.spec import parse_setting

__all__ = ["FAULTS", "faulty_partition", "parse_faulty_clients"]

#: truncate/bitflip/garbage corrupt the payload (the decoders must catch them); hang never answers;
#: crash fails the train message at once (a device that vanishes mid-round: under secure aggregation,
#: after it dealt its shares); signflip and inflate are well-formed Byzantine replies (see ``edge_client.faults``)
FAULTS = ("truncate", "bitflip", "garbage", "hang", "crash", "signflip", "inflate")


@dataclass(frozen=True)
class _FaultyClients:
    fraction: float = 0.2
    fault: str = "signflip"

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; known: {', '.join(FAULTS)}")
        if not (math.isfinite(self.fraction) and 0.0 <= self.fraction <= 1.0):
            raise ValueError(f"faulty-clients fraction must be in [0, 1], got {self.fraction}")


def parse_faulty_clients(spec: str) -> tuple[float, str]:
    """``none`` or ``[faulty-clients:]fraction=F,fault=NAME`` -> (fraction, fault)."""
    parsed = parse_setting(spec, _FaultyClients, "faulty-clients", "faulty-clients", name_optional=True)
    return (0.0, "") if parsed is None else (parsed.fraction, parsed.fault)


def faulty_partition(partition: int, partitions: int, fraction: float) -> bool:
    """Whether partition ``partition`` of ``partitions`` is one of the last ⌈fraction × partitions⌉."""
    return fraction > 0.0 and partition >= partitions - math.ceil(fraction * partitions)
