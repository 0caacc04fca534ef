"""Every setting checked before any process starts.

A spec that cannot work (``--server-opt fedadm``, ``--algorithm gossip:topology=torus`` on 8 nodes,
``--codec qsgd:bits=12``) must fail in the CLI with the reason, not minutes later inside a Ray
worker with Flower's generic exit code. This builds each component the run will build, from the
same factories, and throws the objects away.
"""

from __future__ import annotations

from fedge.aggregation import make_server_optimizer
from fedge.aggregation.broadcast import parse_downlink
from fedge.compression import make_codec
from fedge.protocol.plugins import load_plugins
from fedge.server.settings import RunSettings
from fedge.tasks import make_task
from fedge.tasks.partition import validate_partitioning

__all__ = ["preflight"]


def preflight(settings: RunSettings) -> None:
    """Raise ``ValueError`` (``SettingsError``, ``SpecError``) or ``PluginError`` for the first
    setting that cannot work."""
    load_plugins(settings.plugins)
    make_codec(settings.codec)
    parse_downlink(settings.downlink_codec)
    make_server_optimizer(settings.server_opt)
    task = make_task(settings.task)
    validate_partitioning(settings.partitioning)
    if settings.export_prune:
        from fedge.deploy.prune import parse_pruning

        parse_pruning(settings.export_prune)
    from fedge.server.algorithms.registry import make_algorithm
    from fedge.server.engine.central_dp import central_dp_of
    from fedge.server.engine.loop import make_context, secure_aggregation_of
    from fedge.server.engine.update_guard import UpdateGuard

    UpdateGuard(settings)  # the engine's norm bound and weight cap, for every algorithm
    algorithm = make_algorithm(settings.algorithm, make_context(settings, task))
    secure_aggregation_of(algorithm)  # secure aggregation with what needs individual updates: refused here
    central_dp_of(algorithm)  # differential privacy it cannot account for: refused here
