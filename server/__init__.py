"""The coordinator: Flower ServerApp (``app``), run settings, and by responsibility:

``engine/``      the round lifecycle every algorithm shares (sampling, dispatch, screening, checkpoints)
``algorithms/``  one file per round algorithm and the registry: add an algorithm here
``run/``         what a run leaves on disk (run directory, checkpoint, metrics, plot, initial model)
``daemon/``      ``fedge serve``: the coordinator as a supervised service
``cli/``         the ``fedge`` command: top of the graph, imported by nothing

``local`` runs the app on Flower's engines on this machine; ``flower_app`` stages it for ``flwr run``.
"""
