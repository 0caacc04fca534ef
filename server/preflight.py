"""Every setting checked before any process starts.

A spec that cannot work (``--server-opt fedadm``, ``--algorithm gossip:topology=torus`` on 8 nodes,
``--codec qsgd:bits=12``) must fail in the CLI with the reason, not minutes later inside a Ray
worker with Flower's generic exit code. This builds each component the run will build, from the
same factories, and throws the objects away.
"""

from __future__ import annotations

import warnings

from fedge.aggregation import make_server_optimizer
from fedge.aggregation.broadcast import parse_downlink
from fedge.compression import Codec, make_codec
from fedge.compression.sparse import ThresholdCodec, TopKCodec
from fedge.protocol.plugins import load_plugins
from fedge.server.settings import RunSettings, SettingsError
from fedge.tasks import Task, make_task
from fedge.tasks.partition import validate_partitioning

__all__ = ["advise", "preflight"]


def preflight(settings: RunSettings, num_partitions: int | None = None) -> None:
    """Raise ``ValueError`` (``SettingsError``, ``SpecError``) or ``PluginError`` for the first
    setting that cannot work. With ``num_partitions`` (the CLI's simulated clients, whose data is
    the task's pool) the partitioning is drawn once here, so a split the pool cannot give (Dirichlet
    shards below their minimum size) fails in the CLI, not in every ClientApp."""
    load_plugins(settings.plugins)
    make_codec(settings.codec)
    parse_downlink(settings.downlink_codec)
    make_server_optimizer(settings.server_opt)
    task = make_task(settings.task)
    validate_partitioning(settings.partitioning)
    if num_partitions is not None:
        _check_split(task, settings.partitioning, num_partitions)
    if settings.export_prune:
        from fedge.deploy.prune import parse_pruning

        parse_pruning(settings.export_prune)
    from fedge.server.algorithms.registry import make_algorithm
    from fedge.server.engine.layers import build_layers
    from fedge.server.engine.loop import make_context

    context = make_context(settings, task)
    context.codec  # noqa: B018  (a codec the engine cannot run is refused here)
    algorithm = make_algorithm(settings.algorithm, context)
    # every layer the run holds (update guard, downlink, secure aggregation, DP, model average):
    # a setting one cannot honour with this algorithm is refused here, with its reason
    build_layers(algorithm)


def _check_split(task: Task, partitioning: str, num_partitions: int) -> None:
    try:
        with warnings.catch_warnings():  # flwr-datasets warns at every failed draw before it gives up
            warnings.simplefilter("ignore")
            task.partition(0, num_partitions, partitioning)
    except SettingsError:
        raise
    except (ValueError, RuntimeError) as err:  # flwr-datasets: "max number of attempts (10) was reached"
        raise SettingsError(
            f"partitioning {partitioning!r} cannot split task {task.spec!r} into {num_partitions} clients ({err}); "
            "use fewer clients, a larger alpha, 'iid', or a smaller minimum ('dirichlet:alpha=A,min_size=N')"
        ) from None


def advise(settings: RunSettings, num_clients: int) -> list[str]:
    """Settings that run but are known to cost accuracy, each with what to set instead (the CLI
    prints them before the run; nothing is refused). Today: a sparse uplink with one device in four
    or fewer per round, aggregated by the plain mean or delivered without a model average, ended 6
    to 13 points below fp32 FedAvg (docs/codecs.md, "Sparsification at partial participation")."""
    from fedge.server.algorithms.registry import algorithm_class

    sparse = _sparsifier(make_codec(settings.codec))
    if sparse is None or "aggregator" not in algorithm_class(settings.algorithm).settings_used or num_clients < 1:
        return []
    if settings.clients_per_round * 4 > num_clients:
        return []
    missing = []
    if settings.aggregator == "mean":
        missing.append("--aggregator sparse-mean")
    if settings.model_average == "none":
        missing.append("--model-average ema:decay=0.8")
    if not missing:
        return []
    return [f"{sparse} at {settings.clients_per_round} of {num_clients} clients per round: sparse uplinks at "
            f"partial participation ended 6-13 points below fp32 FedAvg without {' and '.join(missing)} "
            "(run-config keys of the same names; docs/codecs.md, 'Sparsification at partial participation')"]


def _sparsifier(codec: Codec) -> str | None:
    """The name of the sparsifier (top-k, DGC, threshold) anywhere in a codec's chain, or None."""
    current: Codec | None = codec
    while current is not None:
        if isinstance(current, (TopKCodec, ThresholdCodec)):
            return current.spec.partition(":")[0]
        current = getattr(current, "values", None)
    return None
