"""The engine's layers from the run's settings: one table of setting → constructor, and beside it
every refusal of a combination of features (``COMBINATIONS``).

The layer classes live in ``fedge.coordinator`` (a Flower app uses the same ones): selection (uniform
or Oort), the update guard (norm bound, weight cap), the downlink (full or lattice model to
devices), secure aggregation, differential privacy (central, or distributed under secure
aggregation), the model average; an algorithm adds its own (``Algorithm.layers``: FedNova's,
SCAFFOLD's, EASGD's). The engine calls the run's layers in the order :func:`order_layers` derives
from what each declares it provides and needs, whatever the order they are listed in here. A layer
of one's own is one class with a ``build(algorithm, run_dir)`` classmethod and one
:func:`register_layer` call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord

from fedge.aggregation.model_average import parse_model_average
from fedge.aggregation.update_bounds import make_norm_bound
from fedge.coordinator.dp_layer import DifferentialPrivacyLayer
from fedge.coordinator.downlink_layer import DownlinkLayer, uplink_refusal
from fedge.coordinator.layer import BOUNDED, MODEL, NOISE, SAMPLE, SUM, Exchange, Failure, Layer, LayerOrderError, order_layers
from fedge.coordinator.model_average_layer import ModelAverageLayer
from fedge.coordinator.secure_layer import SecureAggregation
from fedge.coordinator.secure_session import SecureSession
from fedge.coordinator.selection_layer import Oort, SelectionLayer
from fedge.coordinator.update_guard import UpdateGuard
from fedge.privacy.dp_spec import DPSpec, parse_differential_privacy
from fedge.privacy.sampling import RunRate
from fedge.privacy.spec import parse_secure_aggregation
from fedge.server.settings import RunSettings, SettingsError
from fedge.tasks import flatten_state, seeded_initial_params, tensor_sizes, unflatten_state

if TYPE_CHECKING:
    from fedge.server.engine.algorithm import Algorithm

__all__ = ["BOUNDED", "COMBINATIONS", "LAYERS", "MODEL", "NOISE", "SAMPLE", "SUM", "Exchange", "Failure", "Layer",
           "LayerOrderError", "build_layers", "order_layers", "register_layer"]

Builder = Callable[["Algorithm", Any], "Layer | None"]


def _private(s: RunSettings) -> bool:
    return s.differential_privacy.strip().lower() not in ("", "none")


def _secure(s: RunSettings) -> bool:
    return s.secure_aggregation.strip().lower() not in ("", "none")


def _dp_spec(s: RunSettings) -> DPSpec | None:
    return parse_differential_privacy(s.differential_privacy) if _private(s) else None


def _not_device_layers(a: Algorithm) -> bool:
    return not a.device_layers


def _oort(a: Algorithm) -> bool:
    return Oort.parse(a.ctx.settings.selection) is not None


def _clips(a: Algorithm) -> bool:
    return make_norm_bound(a.ctx.settings.update_norm).mode == "clip"


def _per_device(a: Algorithm) -> bool:
    """FedNova's normalisation and SCAFFOLD's control variates need each device's update on its own."""
    return any(layer.key in ("fednova", "scaffold") for layer in a.layers())


_PER_DEVICE = ("it needs each device's update on its own (FedNova divides each by its local steps, SCAFFOLD "
               "sends each device's control change beside it); ")
_SECURE = "secure-aggregation cannot run with algorithm {a.spec!r}: "
_DP = "differential-privacy cannot run with algorithm {a.spec!r}: "


#: every refusal of a combination of features: (feature it refuses, when, why); the feature's
#: constructor below raises the first that holds
COMBINATIONS: list[tuple[str, Callable[[Algorithm], bool], Callable[[Algorithm], str]]] = [
    ("selection", lambda a: _oort(a) and _private(a.ctx.settings),
     lambda a: "selection=oort with differential privacy: the accountant assumes Poisson sampling at a fixed rate, "
               "which choosing by speed and loss breaks; use selection=uniform"),
    ("selection", lambda a: _oort(a) and a.fixed_membership,
     lambda a: f"selection=oort with {a.name}: it runs over a fixed set of nodes"),
    ("guard", lambda a: a.relays_updates and _clips(a),
     lambda a: f"update-norm clip cannot apply to {a.name}: the coordinator relays each encoded message as sent, so "
               "a clipped copy would desynchronise the public copies; use reject:max=M"),
    ("downlink", lambda a: a.ctx.codec.shares_support and ((a.device_handler or a.name) != "fedavg"
                                                            or any(x.key == "easgd" for x in a.layers())),
     lambda a: f"codec {a.ctx.settings.codec!r} sends on the support of the model change each device received; "
               f"{a.name}'s devices do not send an update from that model (FedAvg, FedProx and FedBuff do)"),
    ("secure-aggregation", lambda a: a.asynchronous,
     lambda a: _SECURE.format(a=a) + f"{a.name} aggregates each update as it lands "
               "(asynchronously); secure aggregation only reveals the sum of a whole round"),
    ("secure-aggregation", lambda a: a.aggregate not in ("mean", "sum"),
     lambda a: _SECURE.format(a=a) + f"{a.name} needs each device's update (gossip relays them, "
               "robust rules rank them); secure aggregation only reveals their sum"),
    ("secure-aggregation", _not_device_layers,
     lambda a: _SECURE.format(a=a) + f"the devices of {a.name} run the plugin's own handler, which "
               "does not send its update through Fedge's upload layers, so it would never be masked; register it "
               "with a handler built by fedge.edge_client.layers (see docs/extending.md)"),
    ("secure-aggregation", _per_device,
     lambda a: _SECURE.format(a=a) + _PER_DEVICE + "secure aggregation only reveals their sum"),
    ("secure-aggregation", lambda a: a.ctx.settings.aggregator != "mean",
     lambda a: _SECURE.format(a=a) + f"aggregator {a.ctx.settings.aggregator!r} works on "
               "individual updates; secure aggregation only reveals their sum"),
    ("secure-aggregation", lambda a: a.ctx.settings.update_norm != "none",
     lambda a: _SECURE.format(a=a) + "update-norm bounds each decoded update, which the "
               "coordinator never sees under secure aggregation; the shared grid's clip bounds every coordinate "
               "instead"),
    ("secure-aggregation", lambda a: a.ctx.settings.clients_per_round < 2,
     lambda a: "secure-aggregation needs clients-per-round >= 2: one device's sum is its update"),
    ("differential-privacy", lambda a: a.aggregate != "mean" or a.asynchronous,
     lambda a: _DP.format(a=a) + f"it is implemented for synchronous algorithms that apply "
               f"the mean of their devices' updates (a sum of clipped updates per round, as fedavg), not {a.name}"),
    ("differential-privacy", _not_device_layers,
     lambda a: _DP.format(a=a) + f"the devices of {a.name} run the plugin's own handler, which "
               "does not send its update through Fedge's upload layers, so nothing clips it on the device"),
    ("differential-privacy", lambda a: _secure(a.ctx.settings) and bool(_dp_spec(a.ctx.settings).adaptive),
     lambda a: _DP.format(a=a) + "adaptive clipping needs each device's fitted bit in clear, "
               "which secure aggregation hides; use a fixed clip with secure-aggregation (distributed DP)"),
    ("differential-privacy", _per_device,
     lambda a: _DP.format(a=a) + _PER_DEVICE + "DP hands the coordinator only their noised sum"),
    ("differential-privacy", lambda a: a.ctx.settings.aggregator != "mean",
     lambda a: _DP.format(a=a) + f"aggregator {a.ctx.settings.aggregator!r} has no bounded "
               "sensitivity; use 'mean'"),
    ("differential-privacy", lambda a: bool(a.ctx.settings.leaf_spool) and _dp_spec(a.ctx.settings).tier != "leaf",
     lambda a: f"differential-privacy {_dp_spec(a.ctx.settings).spec!r}: a leaf coordinator passes its clipped sum to its root, which "
               "adds the noise: set tier=leaf,rate=Q"),
    ("differential-privacy", lambda a: _dp_spec(a.ctx.settings).tier == "leaf" and not a.ctx.settings.leaf_spool,
     lambda a: f"differential-privacy {_dp_spec(a.ctx.settings).spec!r}: tier=leaf is a leaf coordinator's part (leaf-spool); a "
               "single-tier run sets no tier"),
    ("differential-privacy", lambda a: bool(_dp_spec(a.ctx.settings).tier) and _secure(a.ctx.settings),
     lambda a: f"differential-privacy {_dp_spec(a.ctx.settings).spec!r}: distributed DP (secure aggregation with DP) over leaves is not "
               "built; use central DP at the root"),
    ("differential-privacy", lambda a: _dp_spec(a.ctx.settings).tier == "root" and a.ctx.settings.codec != "none",
     lambda a: f"differential-privacy {_dp_spec(a.ctx.settings).spec!r}: the root adds its noise to the exact sum of the leaves' clipped "
               f"updates, so the bridges send them uncompressed: codec 'none' at the root, not "
               f"{a.ctx.settings.codec!r}"),
    ("differential-privacy", lambda a: a.ctx.settings.dp_seeded_noise and _secure(a.ctx.settings),
     lambda a: "dp-seeded-noise seeds central DP only: under secure aggregation each device draws its share of the "
               "noise itself, from its OS, and no coordinator setting may change that"),
]


def refuse(feature: str, algorithm: Algorithm) -> None:
    """Raise :class:`SettingsError` with the first of ``feature``'s refusals that holds for the run."""
    for name, holds, why in COMBINATIONS:
        if name == feature and holds(algorithm):
            raise SettingsError(why(algorithm))


@contextmanager
def _refused(prefix: str = "") -> Iterator[None]:
    """A ValueError from parsing or building a layer becomes the run's SettingsError (``prefix``: the setting)."""
    try:
        yield
    except SettingsError:
        raise
    except ValueError as err:
        raise SettingsError(f"{prefix}{err}") from None


def _builds(key: str) -> Callable[[Builder], Builder]:
    def mark(build: Builder) -> Builder:
        build.key = key  # type: ignore[attr-defined]
        return build
    return mark


@_builds("selection")
def _selection(algorithm: Algorithm, run_dir: Any = None) -> Layer | None:
    s = algorithm.ctx.settings
    with _refused():
        rule = Oort.parse(s.selection)
    if rule is None and (_private(s) or algorithm.fixed_membership):
        return None  # uniform: DP samples itself; a fixed membership samples nothing
    refuse("selection", algorithm)
    return SelectionLayer(rule, s.seed, s.clients_per_round)  # uniform: it only counts the engine's sample


@_builds("guard")
def _guard(algorithm: Algorithm, run_dir: Any = None) -> Layer:
    s = algorithm.ctx.settings
    guard = UpdateGuard(s.update_norm, s.weight_cap, private=_private(s), weighted=algorithm.weighted)
    refuse("guard", algorithm)
    return guard


@_builds("downlink")
def _downlink(algorithm: Algorithm, run_dir: Any = None) -> Layer:
    """Every run has one (``none`` ships full models). The lattice's base is the task's seeded initial
    model, which every device builds, or, for a run from a model file (``init``), that file's
    weights, shipped once with each device's first snapshot."""
    ctx, s = algorithm.ctx, algorithm.ctx.settings
    refuse("downlink", algorithm)
    template = ctx.template
    with _refused("downlink-codec: "):
        layer = DownlinkLayer(s.downlink_codec, track_supports=ctx.codec.shares_support,
                              full_record=lambda params: ArrayRecord(unflatten_state(params, template)))
    reason = uplink_refusal(ctx.codec, layer)
    if reason is not None:
        raise SettingsError(f"codec {s.codec!r} {reason} (downlink-codec = \"lattice:...\")")
    if layer.parsed is not None:  # from a model file, the base is that model (shipped, set in start())
        base = flatten_state(template) if s.init else seeded_initial_params(ctx.task, s.seed)
        layer.begin(base, tensor_sizes(template), seeded=not s.init)
        if s.init:
            layer.ship_start()
    return layer


@_builds("secure")
def _secure_aggregation(algorithm: Algorithm, run_dir: Any = None) -> Layer | None:
    s = algorithm.ctx.settings
    with _refused("secure-aggregation: "):
        spec = parse_secure_aggregation(s.secure_aggregation)
    if spec is None:
        return None
    refuse("secure-aggregation", algorithm)
    with _refused("secure-aggregation: "):  # the layer refuses what it cannot carry (a credential, say)
        return SecureAggregation(SecureSession(spec, s.seed), algorithm.ctx.numel, weighted=algorithm.weighted,
                                 dp_spec=parse_differential_privacy(s.differential_privacy))


@_builds("dp")
def _differential_privacy(algorithm: Algorithm, run_dir: Any = None) -> Layer | None:
    """Central DP, or with secure aggregation distributed DP (sampling at clients-per-round over the
    connected devices)."""
    s = algorithm.ctx.settings
    with _refused("differential-privacy: "):
        spec = parse_differential_privacy(s.differential_privacy)
    if spec is None:
        return None
    refuse("differential-privacy", algorithm)
    if _secure(s):
        return DifferentialPrivacyLayer.distributed(spec, RunRate(s.clients_per_round, spec.population),
                                                    algorithm.ctx.numel)
    with _refused():
        return DifferentialPrivacyLayer.central(spec, s.clients_per_round,
                                                seeded=s.seed if s.dp_seeded_noise else None)


@_builds("model-average")
def _model_average(algorithm: Algorithm, run_dir: Any = None) -> Layer | None:
    with _refused():
        average = parse_model_average(algorithm.ctx.settings.model_average)
    return None if average is None else ModelAverageLayer(average)


#: setting → constructor: each builds its layer from the run's settings, or None when it is off;
#: their order here means nothing (``order_layers`` decides)
LAYERS: list[Any] = [_selection, _guard, _downlink, _secure_aggregation, _differential_privacy, _model_average]


def register_layer(cls: type[Layer]) -> type[Layer]:
    """Add a layer class with a ``build(algorithm, run_dir)`` classmethod; its ``key`` must be new.
    Where it runs follows from its ``provides`` and ``needs``."""
    if not isinstance(getattr(cls, "key", None), str) or any(c.key == cls.key for c in LAYERS if c is not cls):
        raise ValueError(f"{cls!r} needs a class attribute key (a string) no other layer uses")
    if cls not in LAYERS:
        LAYERS.append(cls)
    return cls


def build_layers(algorithm: Algorithm, run_dir: Any = None) -> list[Layer]:
    """The run's layers, ordered (:func:`order_layers`): those whose settings are on. A setting a
    layer cannot honour with this algorithm, or a combination of layers that cannot work, raises
    ``SettingsError`` with the reason (the CLI's preflight calls this before any process starts)."""
    built = [*(getattr(entry, "build", entry)(algorithm, run_dir) for entry in LAYERS), *algorithm.layers()]
    try:
        return order_layers([layer for layer in built if layer is not None])
    except LayerOrderError as err:
        raise SettingsError(str(err)) from None
