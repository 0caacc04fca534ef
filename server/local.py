"""Run the Fedge app on Flower's engines, on this machine, with every process accounted for.

* ``simulation``: a SuperLink in ``--simulation`` mode; Flower's Simulation Engine (Ray) runs the
  virtual SuperNodes.
* ``deployment``: a SuperLink and N real ``flower-supernode`` processes on 127.0.0.1, each with its own
  partition (node config ``partition-id=i num-partitions=N``), as on real devices.

Both go through the one launch sequence (``fedge.launcher.sequence``): the app staged from the
installed package, submitted with ``flwr run`` against a connection in this run's own ``FLWR_HOME``
on a free port, so concurrent runs and tests never collide with each other or with a user's
``~/.flwr``. Progress comes from the run directory's ``metrics.jsonl``, the same file users read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.launcher.environment import flower_environment
from fedge.privacy.dp_spec import parse_differential_privacy
from fedge.launcher.federation import LoopbackSecurity
from fedge.launcher.processes import ProcessGroup, free_port
from fedge.launcher.sequence import FlowerLaunch, LaunchError
from fedge.launcher.ray_start_hook import HOOK as RAY_HEAD_HOOK
from fedge.server.flower_app import stage_run_app
from fedge.server.preflight import passed_before
from fedge.server.run.metrics_log import MetricsLog
from fedge.server.run.run_directory import RunDirectory
from fedge.protocol.leaf_devices import LeafDevices
from fedge.server.settings import CLIENT_DEVICES, RunSettings
from fedge.tasks.partition import CACHE_ENV, partition_indices

__all__ = ["EngineError", "LaunchResult", "gpu_share", "launch", "leaves_refusal"]

log = logging.getLogger(__name__)


class EngineError(LaunchError):
    """The engine or the run failed; the message says where to look."""


@dataclass
class LaunchResult:
    run_dir: Path
    rows: list[dict[str, Any]]
    summary: dict[str, Any] | None
    seconds: float
    logs: dict[str, Path] = field(default_factory=dict)


def gpu_share(slots: int, gpus: int) -> float:
    """Each simulated ClientApp's share of ``gpus`` GPUs (0: none): the ``slots`` that run at once
    split them, at most one whole GPU each (Flower's ``client-resources-num-gpus``; Ray hides the
    GPUs from an actor that asks for none, so ``--client-device cpu`` simply asks for none)."""
    return 0.0 if gpus <= 0 else min(1.0, round(gpus / max(1, slots), 4))


#: Ray starts a pool of idle Python workers with its raylet and again for the first driver; Flower's
#: actors carry a runtime environment (its PYTHONPATH), so Ray starts workers of their own and the
#: pool only took CPU on the run's critical path (two workers, 0.3 CPU-s each, on this machine).
RAY_LEAN_START = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}


#: torch's threads in a local launch's own processes (the ServerApp above all) unless the caller's
#: environment sets ``OMP_NUM_THREADS``. Each CPU already runs a client (a Ray actor, or a SuperNode's
#: ClientApp, at one thread each: ``fedge.edge_client.threads``), and torch's default pool, a thread
#: per core, made the ServerApp's decode and sum of each reply (38,282 floats) wait for a worker
#: thread the clients had descheduled. One thread: the demo's rounds 2-30 took 12.5-13.6 s against
#: 13.8-14.5 s, in three alternating pairs (bench/results/NOTEBOOK.md, 2026-11-29).
SERVER_THREADS = "1"


#: what a CUDA (or ROCm) driver puts on a machine: without any of them no process here can use a GPU
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def _gpus() -> int:
    """The CUDA devices of this machine: torch's count where a GPU driver is installed, else 0
    without importing torch (1.5-3 s, which a launcher on a CPU machine would pay before it starts
    any process)."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return 0
    from fedge.tasks.device import gpu_count

    return gpu_count()


def _ray_cpus(parallel_clients: int = 0) -> int:
    """The logical CPUs Ray is told about: one actor (one ClientApp at a time) per CPU, or exactly
    ``parallel_clients`` when given (fewer than the cores when several runs share the machine, as a
    benchmark's seeds do: ``bench/harness/seeds.py``)."""
    return parallel_clients if parallel_clients > 0 else max(1, os.cpu_count() or 1)


def _root_settings(settings: RunSettings, leaves: int, devices: int) -> RunSettings:
    """The root's settings over ``leaves`` leaves: secure aggregation runs in each leaf, over its
    devices, and the root sees the leaves' sums; its privacy is its tier's. The weight cap acts in
    the leaves, on what devices claim: a leaf's weight is the sum of its devices' capped weights, not
    a claim, so the root takes it as it is (capped again, the default cap would weigh every leaf 1 in
    the first round, and a fixed cap would cut a large leaf to one device's weight)."""
    return settings.replace(clients_per_round=min(settings.clients_per_round, leaves),
                            min_replies=min(settings.min_replies, leaves), secure_aggregation="none",
                            weight_cap="none",
                            **_tier_privacy(settings, devices, "root"))


def _start_ray_head(group: ProcessGroup, address: str, cpus: int, cwd: Path) -> Path:
    """This run's own Ray instance, ``ray start --head --block`` in the run's group (stopping it stops
    Ray's processes; any that outlive it carry the group's marker). The simulation joins it through
    ``RAY_ADDRESS``: Ray's head then starts with the run instead of after the simulation process has
    loaded the ClientApp, and the actors are placed as soon as Flower asks. Its temporary directory
    (returned) is its own: ``ray start`` records its address there, not in the machine-wide
    ``ray_current_cluster`` file of Ray's default directory, where a user's later ``ray.init()``
    would try to join this run's stopped instance. A short path: Ray's sockets live under it. What
    the head leaves out, and why: ``fedge.launcher.ray_start_hook``."""
    port = address.rpartition(":")[2]
    temp_dir = Path(tempfile.mkdtemp(prefix="fedge-ray-"))
    group.start("ray-head", [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             f"--port={port}", f"--num-cpus={cpus}", f"--temp-dir={temp_dir}",
                             "--include-dashboard=false", "--disable-usage-stats"], cwd=cwd,
                env={"RAY_START_HOOK": RAY_HEAD_HOOK})  # no Ray Client server, no autoscaler monitor
    return temp_dir


def _keep_ray_logs(temp_dir: Path, into: Path) -> bool:
    """A failed run's Ray session logs (GCS, raylet, agents, workers) copied from its head's
    temporary directory into the run's own logs, for its post-mortem: where the run's other logs
    are, and nothing of the run left in the machine's temporary directory. False (the directory
    stays) when they could not be copied."""
    try:
        for logs in temp_dir.glob("session_*/logs"):
            if not logs.parent.is_symlink():  # session_latest names the same session
                shutil.copytree(logs, into / logs.parent.name, dirs_exist_ok=True, ignore_dangling_symlinks=True)
    except (OSError, shutil.Error) as err:
        log.warning("Ray's logs stay in %s (not copied into the run's: %s)", temp_dir, err)
        return False
    return True


def _simulated_federation(nodes: int, *, parallel_clients: int = 0, cluster: bool = False,
                         gpus: int = 0) -> dict[str, Any]:
    """Flower's federation config for ``nodes`` simulated ClientApps, one CPU each. Ray schedules one
    actor per logical CPU it is told about (Flower takes whole CPUs only): ``parallel_clients``
    more logical CPUs than cores means more ClientApps at once. On an existing Ray ``cluster`` the
    nodes declared their CPUs when they started. With ``gpus``, each actor's share of them."""
    config: dict[str, Any] = {"num-supernodes": nodes, "client-resources-num-cpus": 1}
    if not cluster:
        config["init-args-num-cpus"] = _ray_cpus(parallel_clients)
    share = gpu_share(config.get("init-args-num-cpus") or _ray_cpus(parallel_clients), gpus)
    if share:  # Ray hides the GPUs from an actor that asks for none
        config["client-resources-num-gpus"] = share
    return config


def launch(
    settings: RunSettings,
    *,
    engine: str,
    num_supernodes: int,
    flwr_home: Path | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    timeout: float = 3600.0,
    stop_after_round: int | None = None,
    node_config: Mapping[int, Mapping[str, str | int | float]] | None = None,
    parallel_clients: int = 0,
    tls: bool = False,
    app_dir: Path | None = None,
    ray_address: str | None = None,
    isolation: str = "warm",
    client_device: str = "auto",
    leaves: int = 0,
    kill_leaf: tuple[int, int] | None = None,
    leaf_engine: str = "deployment",
    leaf_sample: int = 0,
) -> LaunchResult:
    """Start the engine, run the app to completion (or ``stop_after_round``), stop every process.

    ``stop_after_round`` kills all processes with SIGKILL as soon as that round's metrics line is
    written: a simulated crash of the whole installation, used by the resume test.
    ``node_config`` (deployment only) adds keys to SuperNode ``i``'s node config, e.g.
    ``{1: {"slowdown": 3}}`` for a device three times slower or ``{1: {"fault": "bitflip"}}`` for
    one that corrupts its updates (chaos testing).
    ``parallel_clients`` (simulation only): how many ClientApps Ray runs at once; default one per
    core; fewer when several runs share the machine. Straggler runs set it to the number of clients, so that a slow client sleeping through
    its slowdown occupies its own simulated device, as on real hardware, not one of the few slots
    every other client is queued behind.
    ``tls`` (deployment only): TLS and SuperNode authentication on, as in a real deployment: a CA,
    server certificate and node keys are made in ``<run dir>/tls`` (``fedge.deploy.certs``), every
    node key is registered with ``flwr supernode register`` before its SuperNode starts; under
    secure aggregation every device's identity is issued by that CA (``issuer=`` is added). With
    ``leaves`` every SuperLink of the tree serves TLS: devices register with their leaf's, bridges
    with the root's.
    ``leaves`` (deployment only; 0: one tier): beyond one SuperLink, the ``num_supernodes`` devices
    split over this many leaves, each a SuperLink of its own with its devices and a leaf coordinator
    (``leaf-spool``, ``fedge.server.leaf``); the root's SuperLink has one bridge SuperNode per leaf
    (node config ``leaf-spool``, ``fedge.edge_client.bridge``), and the root runs the settings over
    them (``clients-per-round`` leaves; each leaf steps its devices, all of them per step). A
    bridge waits for its leaf at most 0.8 x ``round-timeout``, so that a dead leaf's bridge answers
    its root round with an error before the root closes it, and is free for the next one.
    ``leaf_engine`` (with leaves): ``deployment`` gives each leaf a SuperNode per device;
    ``simulation`` runs each leaf's devices under Flower's Simulation Engine (a SuperLink in
    ``--simulation`` mode, a Ray instance per leaf, the devices stateful between the steps they are
    sampled in), each simulated node training as the device of the same partition a deployed leaf
    would give it (run setting ``leaf-devices``, ``fedge.edge_client.leaf_devices``); the root and
    its bridges stay a deployment. ``leaf_sample`` (with leaves): devices each leaf samples per
    step (0: all of its devices).
    ``kill_leaf=(i, r)`` (with leaves): a power cut of one leaf, for the fault tests: every process
    of leaf ``i`` is SIGKILLed once the root's row of round ``r`` is written, and the leaf is
    started again once the root's next row is (it resumes from its checkpoint).
    ``ray_address`` (simulation only): run the ClientApps on an existing Ray cluster (``ray start
    --head`` plus ``ray start --address=...`` on every other machine) instead of a local Ray
    instance; Flower's Ray backend connects through ``RAY_ADDRESS`` and schedules one ClientApp per
    CPU across every node of the cluster (docs/operations.md, "Beyond one machine").
    ``isolation`` (deployment only): ``warm`` runs every SuperNode's messages in children forked
    from one pre-imported process; ``subprocess`` is Flower's own (a new ``flwr-clientapp`` process
    per message); see ``fedge.launcher.isolation``.
    """
    if engine not in ("simulation", "deployment"):
        raise ValueError(f"engine must be 'simulation' or 'deployment', got {engine!r}")
    if not settings.run_dir:
        raise ValueError("launch needs an explicit run directory")
    why = leaves_refusal(settings, leaves, num_supernodes, engine, leaf_engine=leaf_engine, tls=tls,
                         leaf_sample=leaf_sample) if leaves else None
    if why is not None:
        raise ValueError(f"leaves={leaves}: {why}")
    if kill_leaf is not None and not 0 <= kill_leaf[0] < leaves:
        raise ValueError(f"kill_leaf={kill_leaf}: there is no leaf {kill_leaf[0]} of {leaves}")
    if tls and engine != "deployment":
        raise ValueError("tls applies to the deployment engine (simulated nodes do not connect)")
    if ray_address and engine != "simulation":
        raise ValueError("ray_address applies to the simulation engine")
    if client_device not in CLIENT_DEVICES:
        raise ValueError(f"client_device must be one of {', '.join(CLIENT_DEVICES)}, got {client_device!r}")
    gpus_here = _gpus() if client_device != "cpu" else 0
    if client_device == "cuda" and not gpus_here:
        raise EngineError("--client-device cuda, but this machine has no CUDA device; use auto or cpu")
    run_dir = Path(settings.run_dir).resolve()
    if tls:  # a TLS federation's devices are issued their identities by the run's CA (made below)
        settings = settings.replace(
            secure_aggregation=LoopbackSecurity(run_dir / "tls").issue_secure_aggregation(settings.secure_aggregation))
    # what the root's ServerApp will record: a run this directory's run cannot become is refused now,
    # before anything in the directory is touched (not after the earlier run's summary is dropped)
    root_settings = _root_settings(settings, leaves, num_supernodes) if leaves else settings
    RunDirectory(run_dir).prepare_launch(root_settings.replace(run_dir=str(run_dir)))
    flwr_home = (flwr_home or run_dir / "flwr-home").resolve()
    env = flower_environment(flwr_home)
    # A simulation gets a Ray instance of its own, never a cluster some other `ray start` left running
    # on this machine (ray.init() would otherwise join it and refuse Flower's num_cpus), even when
    # the caller's environment names one: only ``ray_address`` selects a cluster. Its head starts
    # first thing, while the SuperLink, the app and the simulation process start, not after them.
    ray_head = f"127.0.0.1:{free_port()}" if engine == "simulation" and not (ray_address or leaves) else None
    env["RAY_ADDRESS"] = ray_address or ray_head or "local"
    env.update(RAY_LEAN_START)
    if not ray_address:
        env.setdefault("OMP_NUM_THREADS", SERVER_THREADS)  # every CPU here is a client's
        env[CACHE_ENV] = str(run_dir / "partitions")  # a Ray cluster's other machines have no such directory
    started = time.monotonic()
    # one key per device and, with leaves, one per bridge (node-N, node-N+1, ...)
    security = LoopbackSecurity.create(run_dir / "tls", num_supernodes + leaves) if tls else None
    run_config = settings.replace(run_dir=str(run_dir)).to_run_config()

    group = ProcessGroup(run_dir / "logs", env=env, also_match={"FLWR_HOME": env["FLWR_HOME"]})
    ray_temp: Path | None = None
    tiers: list[tuple[ProcessGroup, Path]] = []  # each leaf's processes and spool
    share_settings = settings
    shared = False  # the run's partitions drawn where every node reads them

    def meanwhile() -> None:  # while the SuperLink starts (a second or two): the run's partitions, its app
        nonlocal app, shared
        if not ray_address:
            shared = _share_partitions(share_settings, num_supernodes, run_dir / "partitions")
        app = stage_run_app(flwr_home / "app", share_settings.task, app_dir, share_settings.plugins)

    app = flwr_home / "app"
    try:
        if ray_head:
            ray_temp = _start_ray_head(group, ray_head, _ray_cpus(parallel_clients), run_dir)
        if leaves:
            meanwhile()  # each leaf's processes read the partitions and the app as they start
            leaf_plan = _LeafPlan(leaves, num_supernodes, leaf_engine, leaf_sample, isolation, security)
            for i in range(leaves):  # one at a time: a leaf that fails to start leaves the started ones stoppable
                tiers.append(_start_leaf(i, leaf_plan, settings, run_dir, app))
            settings = root_settings
            run_config = settings.replace(run_dir=str(run_dir)).to_run_config()
        flower = FlowerLaunch(group, flwr_home, isolation=isolation if engine == "deployment" else "subprocess")
        flower.start_superlink(tls=security.server if security else None, simulation=engine == "simulation",
                               cwd=run_dir, meanwhile=None if leaves else meanwhile)
        federation_config: dict[str, Any] = {}
        if leaves:  # the root's nodes: one bridge per leaf
            from fedge.protocol.leaf import LEAF_SPOOL, LEAF_TIMEOUT  # the spool's wire (torch): leaves only

            bridge_keys = _registered(flower, security, [num_supernodes + i for i in range(leaves)])
            for i, (_, spool) in enumerate(tiers):
                flower.start_supernode(i, {"partition-id": i, "num-partitions": leaves, LEAF_SPOOL: str(spool),
                                           LEAF_TIMEOUT: 0.8 * settings.round_timeout},
                                       auth_key=bridge_keys.get(num_supernodes + i), cwd=run_dir)
            flower.start_warm_executor(cwd=run_dir, partitions=False)
        elif engine == "deployment":
            node_keys = _registered(flower, security, list(range(num_supernodes)))
            for i in range(num_supernodes):
                # cache-dir: each node reads its partition from a small .npz instead of rebuilding
                # it (scikit-learn, datasets) in every ClientApp process (edge_client/node_data.py).
                config = {"partition-id": i, "num-partitions": num_supernodes,
                          "cache-dir": str(run_dir / "node-cache"),
                          **({"device": client_device} if client_device != "auto" else {}),
                          **((node_config or {}).get(i) or {})}
                if security:
                    config = {**security.node_identity(i), **config}
                flower.start_supernode(i, config, auth_key=node_keys.get(i), cwd=run_dir)
            # scikit-learn and datasets (130 MiB in the warm process and every message it forks) are
            # preloaded only where a node draws its partition itself: a device with its own data file
            # never does, nor does a node whose partition this process drew (bench/clientapp_cpu.py)
            own_data = all("data" in ((node_config or {}).get(i) or {}) for i in range(num_supernodes))
            flower.start_warm_executor(cwd=run_dir, partitions=not (own_data or shared))
        else:
            federation_config = _simulated_federation(num_supernodes, parallel_clients=parallel_clients,
                                                     cluster=bool(ray_address or ray_head), gpus=gpus_here)
        runner = flower.submit(app, run_config, federation_config=federation_config, cwd=run_dir)
        if kill_leaf is not None:
            on_row = _leaf_power_cut(kill_leaf, tiers, lambda i: _start_leaf(i, leaf_plan, share_settings, run_dir, app),
                                     on_row)
        rows = _follow(flower, run_dir, runner, on_row, started + timeout, stop_after_round)
    except LaunchError as err:
        raise EngineError(str(err)) from None
    finally:
        _stop_leaves(tiers)  # the root's run is over: each leaf stops serving, then everything
        finished = (run_dir / "summary.json").exists()  # its results are on disk: what is left is teardown
        group.stop(grace=0.3 if finished else 10.0, finished=finished)
        if ray_temp is not None and (finished or _keep_ray_logs(ray_temp, run_dir / "logs" / "ray")):
            shutil.rmtree(ray_temp, ignore_errors=True)
        for leaf_group, _ in tiers:
            leaf_group.stop()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return LaunchResult(
        run_dir=run_dir,
        rows=rows,
        summary=summary,
        seconds=time.monotonic() - started,
        logs={p.stem: p for p in (run_dir / "logs").glob("*.log")},
    )


def _leaf_power_cut(kill: tuple[int, int], tiers: list[tuple[ProcessGroup, Path]],
                    restart: Callable[[int], tuple[ProcessGroup, Path]],
                    on_row: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
    """``on_row`` that also kills leaf ``kill[0]`` after the root's round ``kill[1]`` and starts it
    again after the next one (``launch``'s ``kill_leaf``)."""
    leaf, after = kill

    def row_seen(row: dict[str, Any]) -> None:
        if row["round"] == after:
            log.info("simulating a power cut of leaf %d after root round %d", leaf, after)
            tiers[leaf][0].kill_all()
        elif row["round"] == after + 1:
            log.info("starting leaf %d again after root round %d", leaf, row["round"])
            tiers[leaf][0].stop(grace=0.0)  # reaps what the cut left
            tiers[leaf] = restart(leaf)
        if on_row is not None:
            on_row(row)

    return row_seen


def _share_partitions(settings: RunSettings, num_partitions: int, directory: Path) -> bool:
    """Draw the run's partitions once, here, into the directory every process of the run reads them
    from (``FEDGE_PARTITION_CACHE``, ``fedge.tasks.partition``): otherwise each Ray actor and each
    SuperNode imports flwr-datasets (~1.8 CPU-s) and draws the same split again. Only a speed-up: a
    task this process cannot build (a user's module found only in the app) is drawn by the nodes,
    and then this returns False."""
    if passed_before(settings, num_partitions):  # its preflight drew this split into the machine's cache
        return True  # where every node finds it (``partition_indices``); no torch here for the task
    from fedge.tasks import make_task  # torch: the run's task

    try:
        task = make_task(settings.task)
        pool = task.train_pool()
        partition_indices(task.partition_labels(pool), settings.partitioning, num_partitions, 0,
                          size=len(pool), cache_dir=directory)  # type: ignore[arg-type]
    except Exception as err:  # noqa: BLE001 - the nodes draw it themselves and report what fails
        log.info("partitions not drawn ahead of the run (each node draws its own): %s", err)
        return False
    return True


def _stop_leaves(tiers: list[tuple[ProcessGroup, Path]]) -> None:
    """Tell each leaf its root's run is over (its spool's stop file)."""
    if tiers:
        from fedge.protocol.leaf import LEAF_STOP

        for _, spool in tiers:
            (spool / LEAF_STOP).touch()


def _registered(flower: FlowerLaunch, security: LoopbackSecurity | None, indices: list[int]) -> dict[int, Path]:
    """The private keys of nodes ``indices``, their public keys registered with ``flower``'s
    SuperLink in one process before any of them starts (none without TLS: nodes connect
    unauthenticated)."""
    if security is None:
        return {}
    keys = {index: security.node_key(index) for index in indices}
    flower.register([(key.with_suffix(".pub"), f"node-{index}") for index, key in keys.items()])
    return keys


def leaves_refusal(settings: RunSettings, leaves: int, devices: int, engine: str, *, leaf_engine: str = "deployment",
                   tls: bool = False, leaf_sample: int = 0) -> str | None:
    """Why ``leaves`` leaves over ``devices`` devices cannot run (None: they can): the one rule the
    CLI applies before any process starts and :func:`launch` applies to every caller."""
    if engine != "deployment":
        return "leaves are SuperLinks of their own: the deployment engine (fedge local-cluster)"
    if not 1 <= leaves <= devices // 2:
        return f"each leaf needs at least 2 of the {devices} devices"
    if leaf_engine not in ("deployment", "simulation"):
        return f"a leaf's engine is deployment or simulation, not {leaf_engine!r}"
    if leaf_engine == "simulation" and tls:
        return "a simulated leaf's devices do not connect to it: TLS is for deployed leaves"
    if leaf_sample < 0:
        return f"each leaf samples 0 (all) or more of its devices per step, not {leaf_sample}"
    spec = parse_differential_privacy(settings.differential_privacy)
    if spec is not None and spec.adaptive:
        return "adaptive clipping with leaves is not built; use a fixed clip"
    if spec is not None and settings.secure_aggregation != "none":
        return ("distributed DP (secure aggregation with DP) over leaves is not built; central DP at the root "
                "runs without secure-aggregation")
    return None


def _tier_privacy(settings: RunSettings, devices: int, tier: str) -> dict[str, str]:
    """Central DP over leaves, the part of ``tier`` (``fedge.privacy.dp_spec``): the leaves sample
    their devices at the federation's rate q = clients-per-round / devices and clip; the root adds
    the noise to the exact sum of their sums (its bridges send them uncompressed) and accounts at q."""
    spec = parse_differential_privacy(settings.differential_privacy)
    if spec is None:
        return {}
    rate = min(1.0, settings.clients_per_round / devices)
    tiered = {"differential_privacy": dataclasses.replace(spec, tier=tier, rate=rate).spec}
    return {**tiered, "codec": "none"} if tier == "root" else tiered


@dataclass(frozen=True)
class _LeafPlan:
    """How a launch's leaves are made (the same for each leaf, and for a leaf started again)."""

    leaves: int
    devices: int
    engine: str
    sample: int
    isolation: str
    security: LoopbackSecurity | None


def _start_leaf(index: int, plan: _LeafPlan, settings: RunSettings, run_dir: Path,
                app: Path) -> tuple[ProcessGroup, Path]:
    """Leaf ``index`` of ``plan.leaves``: its own SuperLink, its share of the devices (their
    partitions of the whole data set, as in a one-tier run) and its coordinator's run, serving the
    root through ``<run dir>/leaf-<index>/spool``; its processes and that spool. Deployed, each
    device is a SuperNode; with ``plan.security`` the leaf's SuperLink serves TLS with the run's
    server certificate and authenticates its devices, each registered with its own key
    (``node-<partition>``) and issued its secure-aggregation identity, as in a one-tier TLS run.
    Simulated, the leaf's SuperLink runs them under Flower's Simulation Engine (its own Ray
    instance), each node mapped to its device's partition (``leaf-devices``)."""
    from fedge.protocol.leaf import LEAF_STOP

    leaf_dir = run_dir / f"leaf-{index}"
    spool = leaf_dir / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    (spool / LEAF_STOP).unlink(missing_ok=True)  # an earlier launch's stop: this one serves the resumed root
    home = leaf_dir / "flwr-home"
    env = flower_environment(home)
    env["RAY_ADDRESS"] = "local"
    env[CACHE_ENV] = str(run_dir / "partitions")
    group = ProcessGroup(leaf_dir / "logs", env=env, also_match={"FLWR_HOME": env["FLWR_HOME"]})
    try:
        _serve_leaf(index, plan, settings, run_dir, app, group, home)
    except BaseException:  # a key Flower refused, a node that died: nothing of this leaf outlives the launch
        group.stop()
        raise
    return group, spool


def _serve_leaf(index: int, plan: _LeafPlan, settings: RunSettings, run_dir: Path, app: Path, group: ProcessGroup,
                home: Path) -> None:
    """Start leaf ``index``'s processes in its ``group`` (:func:`_start_leaf`)."""
    leaf_dir = home.parent
    mapping = LeafDevices(index, plan.leaves, plan.devices)
    simulated = plan.engine == "simulation"
    flower = FlowerLaunch(group, home, isolation="subprocess" if simulated else plan.isolation)
    security = None if simulated else plan.security
    flower.start_superlink(tls=security.server if security else None, simulation=simulated, cwd=leaf_dir)
    federation_config: dict[str, Any] = {}
    if simulated:  # no GPU share: two leaves' Ray instances would each hand out the same GPUs
        federation_config = _simulated_federation(mapping.nodes)
    else:
        node_keys = _registered(flower, security, [mapping.device(j) for j in range(mapping.nodes)])
        for j in range(mapping.nodes):
            partition = mapping.device(j)
            config = {"partition-id": partition, "num-partitions": plan.devices,
                      "cache-dir": str(run_dir / "node-cache"),
                      **(security.node_identity(partition) if security else {})}
            flower.start_supernode(j, config, auth_key=node_keys.get(partition), cwd=leaf_dir)
    # A leaf's step is a plain FedAvg step over its devices (all of them, or its sample) from the
    # root's model (HierFAVG's edge average); the root's algorithm (FedAvg, FedBuff across leaves),
    # its server optimizer and its model average act on the leaves' steps.
    sampled = min(plan.sample, mapping.nodes) if plan.sample else mapping.nodes
    leaf = settings.replace(run_dir=str(leaf_dir), leaf_spool=str(leaf_dir / "spool"), clients_per_round=sampled,
                            min_replies=min(settings.min_replies, sampled), export_bundle="",
                            algorithm="fedavg", server_opt="fedavg", model_average="none",
                            leaf_devices=mapping.spec if simulated else "",
                            **_tier_privacy(settings, plan.devices, "leaf"))
    flower.submit(app, leaf.to_run_config(), federation_config=federation_config, cwd=leaf_dir)


def _follow(
    flower: FlowerLaunch,
    run_dir: Path,
    runner: Any,
    on_row: Callable[[dict[str, Any]], None] | None,
    deadline: float,
    stop_after_round: int | None,
) -> list[dict[str, Any]]:
    """Report metrics rows as they appear until ``flwr run`` exits; raise on failure or timeout."""
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    summary = run_dir / "summary.json"
    rows: list[dict[str, Any]] = []
    seen = 0

    def tick() -> bool:
        nonlocal rows, seen
        # The summary is the ServerApp's last write (after the last row, model.pt and the bundle,
        # each atomic): seen before the rows are read, it means they are all there and the run is
        # over. Flower's teardown after it (Ray's actors and the simulation process, the log stream,
        # the run's status) took 4-5 s of every demo's wall time; the group's stop ends those
        # processes as it would at the end of the stream.
        over = summary.exists()
        rows = metrics.read()
        for row in rows[seen:]:
            if on_row:
                on_row(row)
            if stop_after_round is not None and row["round"] >= stop_after_round:
                log.info("simulating a crash after round %d: killing every process", row["round"])
                flower.group.kill_all()
                return True
        seen = len(rows)
        return over

    if not flower.follow(runner, deadline, tick):
        return rows
    if runner.popen.returncode != 0 or not summary.exists():
        code = runner.popen.returncode  # 0 with no summary: the ServerApp raised inside the simulation
        why = f"flwr run exit code {code}" if code != 0 else "flwr run exited 0 but the ServerApp never finished"
        raise EngineError(f"the Flower run failed ({why}); logs in {run_dir / 'logs'}:\n{runner.log_tail(30)}")
    return rows
