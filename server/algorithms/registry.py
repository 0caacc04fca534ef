"""The algorithm registry: spec string -> round algorithm, through the grammar codecs use.

``fedavg``; ``easgd[:alpha=0.3,beta=0.9]``; ``gossip[:topology=ring,gamma=1,degree=4,measure=1]``;
``fedbuff[:concurrency=C,buffer=K,staleness=poly,a=0.5,max-staleness=20]``;
``fedasync[:alpha=0.6,concurrency=C,staleness=poly,a=0.5,max-staleness=20]``.
"""

from __future__ import annotations

from collections.abc import Callable

from fedge.compression.spec import build_from_spec, parse_spec
from fedge.server.engine.algorithm import Algorithm, RunContext
from fedge.server.algorithms.easgd import EASGD
from fedge.server.algorithms.fedasync import FedAsync
from fedge.server.algorithms.fedavg import FedAvg
from fedge.server.algorithms.fedbuff import FedBuff
from fedge.server.algorithms.gossip import Gossip

__all__ = ["ALGORITHMS", "available_algorithms", "make_algorithm"]

ALGORITHMS: dict[str, Callable[..., Algorithm]] = {"fedavg": FedAvg, "easgd": EASGD, "gossip": Gossip,
                                                  "fedbuff": FedBuff, "fedasync": FedAsync}


def available_algorithms() -> list[str]:
    return sorted(ALGORITHMS)


def make_algorithm(spec: str, ctx: RunContext) -> Algorithm:
    """Build the algorithm ``spec`` names for the run ``ctx`` (parameters typed and validated)."""
    algorithm = build_from_spec(spec, ALGORITHMS, family="algorithm", extra={"ctx": ctx})
    assert isinstance(algorithm, Algorithm)
    return algorithm


def algorithm_name(spec: str) -> str:
    return parse_spec(spec)[0]
