"""Fedge aggregation: the pure math of combining client updates (no Flower, no I/O)."""

from fedge.aggregation.server_optimizers import (
    ServerOptimizer,
    available_server_optimizers,
    make_server_optimizer,
)
from fedge.aggregation.streaming_mean import StreamingMean

__all__ = [
    "ServerOptimizer",
    "StreamingMean",
    "available_server_optimizers",
    "make_server_optimizer",
]
