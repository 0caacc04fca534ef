"""Every setting checked before any process starts.

A spec that cannot work (``--server-opt fedadm``, ``--algorithm gossip:topology=torus`` on 8 nodes,
``--codec qsgd:bits=12``) must fail in the CLI with the reason, not minutes later inside a Ray
worker with Flower's generic exit code. This builds each component the run will build, from the
same factories, and throws the objects away.

Building them needs torch (1.5-3 s to import on a 2-core machine, and the checks about a second
more), and that time came before ``fedge demo`` started any process. A check's outcome is a pure
function of the settings, Fedge's code and the installed libraries when the task is a built-in
one that reads no file a package may add (``digits``, ``synthetic``) and no plugin is loaded, so
a passed check is remembered on this machine (``<cache>/preflight/``, keyed by all three) and a
later run of the same settings skips it: the CLI then imports no torch before the SuperLink
starts. Any change to a setting, to a file of Fedge's or to a library's version is another key,
checked afresh; a refused setting is never remembered, so it is refused again with its reason.
``FEDGE_PREFLIGHT_CACHE=off`` checks every time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import warnings
from collections.abc import Callable
from functools import cache
from importlib import metadata, util
from pathlib import Path
from typing import TYPE_CHECKING

from fedge.compression.kernel_cache import cache_dir
from fedge.compression.spec import parse_spec
from fedge.deploy.atomic import atomic_write_text
from fedge.server.settings import RunSettings, SettingsError

if TYPE_CHECKING:
    from fedge.compression import Codec
    from fedge.tasks import Task

__all__ = ["advise", "passed_before", "preflight"]

log = logging.getLogger(__name__)

#: built-in tasks whose checks read nothing beyond the settings, the code and the libraries
#: (``fashion`` reads a dataset a Debian package may add or remove; any other task is user code)
VERDICT_TASKS = ("digits", "synthetic")
#: the folders of Fedge whose files the checks run, and the libraries whose versions they depend on
_LAYERS = ("aggregation", "compression", "deploy", "edge_client", "launcher", "privacy", "protocol", "server",
           "tasks")
_LIBRARIES = ("torch", "flwr", "flwr-datasets", "datasets", "numpy", "scikit-learn", "numba")


def preflight(settings: RunSettings, num_partitions: int | None = None) -> None:
    """Raise ``ValueError`` (``SettingsError``, ``SpecError``) or ``PluginError`` for the first
    setting that cannot work. With ``num_partitions`` (the CLI's simulated clients, whose data is
    the task's pool) the partitioning is drawn once here, so a split the pool cannot give (Dirichlet
    shards below their minimum size) fails in the CLI, not in every ClientApp. Skipped when these
    settings passed before on this machine (module docstring)."""
    _remembered("preflight", settings, num_partitions, lambda: _check(settings, num_partitions) or [])


def passed_before(settings: RunSettings, num_partitions: int | None = None) -> bool:
    """Whether :func:`preflight` of these settings passed on this machine, with this code and these
    libraries (so the split it drew for ``num_partitions`` clients is in the machine's cache)."""
    path = _verdict_path("preflight", settings, num_partitions)
    return path is not None and _read(path) is not None


def _check(settings: RunSettings, num_partitions: int | None) -> None:
    from fedge.aggregation import make_server_optimizer
    from fedge.aggregation.broadcast import parse_downlink
    from fedge.compression import make_codec
    from fedge.protocol.plugins import load_plugins
    from fedge.tasks import make_task
    from fedge.tasks.partition import validate_partitioning

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


def _remembered(kind: str, settings: RunSettings, count: int | None,
                compute: Callable[[], list[str]]) -> list[str]:
    """``compute()`` (a check's notes; it raises to refuse), or what it returned when it passed
    before for the same key. A passed check is written down atomically with the warnings Fedge's
    loggers gave while it ran (a codec that is not contractive, ...), which a remembered one gives
    again: the user reads the same lines either way."""
    path = _verdict_path(kind, settings, count)
    remembered = None if path is None else _read(path)
    if remembered is not None:
        notes, warned = remembered
        for name, message in warned:
            logging.getLogger(name).warning("%s", message)
        return notes
    capture = _Warnings()
    root = logging.getLogger("fedge")
    root.addHandler(capture)
    try:
        notes = compute()
    finally:
        root.removeHandler(capture)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({"notes": notes, "warnings": capture.seen}) + "\n")
            _prune(path.parent)
        except OSError as err:  # a cache that cannot be written leaves every check as it was
            log.info("cannot remember the %s of these settings in %s: %s", kind, path.parent, err)
    return notes


#: remembered checks kept per machine: every edit of a file of Fedge's is a new key, so a checkout
#: being worked on would otherwise add one small file per run for ever
KEEP = 64


def _prune(directory: Path) -> None:
    """Keep the :data:`KEEP` most recently written records (a forgotten one is only checked again)."""
    records = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in records[KEEP:]:
        old.unlink(missing_ok=True)


class _Warnings(logging.Handler):
    """The (logger, message) of every warning a check logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append([record.name, record.getMessage()])


def _read(path: Path) -> tuple[list[str], list[list[str]]] | None:
    """A remembered check's notes and warnings, or None (none there, or not what this module writes)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        notes, warned = record["notes"], record["warnings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(notes, list) and all(isinstance(n, str) for n in notes) and isinstance(warned, list)
            and all(isinstance(w, list) and len(w) == 2 and all(isinstance(x, str) for x in w) for w in warned)):
        return None
    return notes, warned


def _verdict_path(kind: str, settings: RunSettings, count: int | None) -> Path | None:
    """Where a passed check of ``settings`` is remembered, or None when its outcome may depend on
    more than the key holds (a plugin, a task that is user code or reads optional files)."""
    if os.environ.get("FEDGE_PREFLIGHT_CACHE", "on").lower() in ("off", "0", "false"):
        return None
    try:
        task = parse_spec(settings.task)[0]
    except ValueError:
        return None
    if settings.plugins or task not in VERDICT_TASKS:
        return None
    config = {k: v for k, v in settings.to_run_config().items() if k != "run-dir"}
    key = {"kind": kind, "settings": config, "count": count, "code": _code_digest(), "libraries": _versions(),
           "python": sys.version, "machine": platform.machine()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / "preflight" / f"{kind}-{digest}.json"


@cache
def _code_digest() -> str:
    """Every Python file of Fedge's, by path, size and modification time (a stat each: ~5 ms)."""
    digest = hashlib.sha256()
    for layer in _LAYERS:
        spec = util.find_spec(f"fedge.{layer}")
        for root in sorted((spec.submodule_search_locations or []) if spec else []):
            for folder, dirs, files in os.walk(root):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                for name in sorted(f for f in files if f.endswith(".py")):
                    stat = os.stat(os.path.join(folder, name))
                    digest.update(f"{layer}/{os.path.relpath(os.path.join(folder, name), root)}|{stat.st_size}|"
                                  f"{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


@cache
def _versions() -> dict[str, str]:
    out = {}
    for name in _LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = ""
    return out


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
    to 13 points below fp32 FedAvg (docs/codecs.md, "Sparsification at partial participation").
    Remembered as :func:`preflight` is."""
    return _remembered("advice", settings, num_clients, lambda: _advice(settings, num_clients))


def _advice(settings: RunSettings, num_clients: int) -> list[str]:
    from fedge.compression import make_codec
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
    from fedge.compression.sparse import ThresholdCodec, TopKCodec

    current: Codec | None = codec
    while current is not None:
        if isinstance(current, (TopKCodec, ThresholdCodec)):
            return current.spec.partition(":")[0]
        current = getattr(current, "values", None)
    return None
