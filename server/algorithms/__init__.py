"""Round algorithms, one file each, and the registry (``registry``): spec string -> algorithm.

Add an algorithm here: its server file (found by the registry through its ``name``), its device
handler in ``fedge.edge_client.algorithms`` (unless it reuses one) and its test; nothing else.
"""

from fedge.server.algorithms.registry import algorithms, available_algorithms, make_algorithm

__all__ = ["algorithms", "available_algorithms", "make_algorithm"]
