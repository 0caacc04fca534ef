"""The ``faulty-clients`` run setting, read by the coordinator (validation) and the devices (the
fault-injection mod): ``none`` or ``fraction=F,fault=NAME``.

A SuperNode's own node config ``fault=NAME`` injects a fault on one device; this setting does it in
a simulation, whose virtual nodes share one node config: the *last* ⌈F × num-partitions⌉ partitions
misbehave (stragglers take the first ones, so the two can be combined without overlap).
"""

from __future__ import annotations

import math

from fedge.compression.spec import parse_spec

__all__ = ["FAULTS", "faulty_partition", "parse_faulty_clients"]

#: truncate/bitflip/garbage corrupt the payload (the decoders must catch them); hang never answers;
#: crash fails the train message at once (a device that vanishes mid-round: under secure aggregation,
#: after it dealt its shares); signflip and inflate are well-formed Byzantine replies (see ``edge_client.faults``)
FAULTS = ("truncate", "bitflip", "garbage", "hang", "crash", "signflip", "inflate")


def parse_faulty_clients(spec: str) -> tuple[float, str]:
    """``none`` or ``fraction=F,fault=NAME`` -> (fraction, fault)."""
    if not spec or spec.strip().lower() == "none":
        return 0.0, ""
    text = spec if ":" in spec else f"faulty-clients:{spec}"
    _, params = parse_spec(text)
    unknown = set(params) - {"fraction", "fault"}
    if unknown:
        raise ValueError(f"faulty-clients takes fraction= and fault=, not {sorted(unknown)}")
    fault = str(params.get("fault", "signflip"))
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    try:
        fraction = float(params.get("fraction", 0.2))
    except ValueError as err:
        raise ValueError(f"faulty-clients {spec!r}: {err}") from None
    if not (math.isfinite(fraction) and 0.0 <= fraction <= 1.0):
        raise ValueError(f"faulty-clients fraction must be in [0, 1], got {fraction}")
    return fraction, fault


def faulty_partition(partition: int, partitions: int, fraction: float) -> bool:
    """Whether partition ``partition`` of ``partitions`` is one of the last ⌈fraction × partitions⌉."""
    return fraction > 0.0 and partition >= partitions - math.ceil(fraction * partitions)
