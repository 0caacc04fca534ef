"""Round algorithms, one file each, and the registry (``registry``): spec string -> algorithm.

Add an algorithm here: its server file, its device handler in ``fedge.edge_client``, its registry
entry and its test.
"""

from fedge.server.algorithms.registry import ALGORITHMS, available_algorithms, make_algorithm

__all__ = ["ALGORITHMS", "available_algorithms", "make_algorithm"]
