"""The process layer: Flower's own processes started, connected and stopped on this machine.

``processes`` (lifetimes: a process group that always stops), ``federation`` (SuperLink / SuperNode
command lines, TLS, the ``flwr`` connection, node registration), ``environment`` (what every Flower
process gets in its environment, run-config arguments), ``app_bundle`` (the directory ``flwr run``
builds its app bundle from) and ``sequence`` (the one launch sequence: SuperLink, wait, SuperNodes,
``flwr run``, follow). The coordinator's CLI and daemon, ``fedge-edge join`` and the benchmarks all
start Flower through here; this layer imports nothing of Fedge but ``deploy.certs``.
"""
