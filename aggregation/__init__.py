"""Fedge aggregation: the pure math of combining client updates (no Flower, no I/O)."""

from fedge.aggregation.server_optimizers import (
    ServerOptimizer,
    available_server_optimizers,
    make_server_optimizer,
)
from fedge.aggregation.robust import Aggregator, register_aggregator
from fedge.aggregation.streaming_mean import StreamingMean
from fedge.aggregation.sparse_mean import SparseMean

register_aggregator("sparse-mean", SparseMean)  # here, not in robust.py: sparse_mean imports robust

__all__ = [
    "Aggregator",
    "ServerOptimizer",
    "SparseMean",
    "StreamingMean",
    "available_server_optimizers",
    "make_server_optimizer",
    "register_aggregator",
]
