"""``secure(strategy, secure_aggregation="secagg:...")``: a user's strategy that sees only the sum
(docs/flower.md, "Secure aggregation"; SECURITY.md for what the coordinator learns).

It is :func:`fedge.flower.layered` with the engine's secure-aggregation layer and, under
distributed DP, its distributed-DP layer (``fedge.protocol``): its stages reach the devices as
``train`` messages carrying the ``secagg`` record (Flower's SecAgg+ convention; the ClientApp needs
:func:`fedge.edge_client.secure_mod`). What it builds is checked here, when wrapped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedge.compression import make_codec
from fedge.compression.spec import required_spec
from fedge.flower.layered import LayeredStrategy, mean_refusal
from fedge.privacy.dp_spec import parse_differential_privacy
from fedge.privacy.spec import parse_secure_aggregation
from fedge.coordinator.dp_layer import DifferentialPrivacyLayer
from fedge.coordinator.layer import Layer
from fedge.coordinator.secure_layer import SecureAggregation
from fedge.coordinator.secure_session import SecureSession
from fedge.protocol.layout import Layout

__all__ = ["distributed_dp", "SecureStrategy", "refuse_reason", "secure"]

log = logging.getLogger(__name__)


def refuse_reason(strategy: Strategy, layers: Iterable[Layer] = (), uplink: str | None = None) -> str | None:
    """Why ``strategy`` (with ``layers`` and ``uplink``, from ``secure(layered(strategy, *layers))`` or
    ``secure(compressed(strategy, ...))``) cannot run on a securely aggregated sum (None: it can).
    ``secure(compressed(s, uplink="none", downlink="lattice:..."))`` composes: the lattice downlink
    ships the model, secure aggregation is the uplink."""
    changing = [layer.key for layer in layers if type(layer).update is not Layer.update]
    if changing:
        return (f"layer {', '.join(changing)} changes each update, which secure aggregation never shows the "
                "coordinator; only layers that act on the round (select, release, close) run under it")
    if getattr(strategy, "masks_updates", False):
        return "it is secure(...) already"
    if uplink is not None and make_codec(uplink).spec != "none":
        return ("secure aggregation quantizes each update itself (secagg:bits=...) and the coordinator never "
                "sees one to decode: give compressed() uplink=\"none\" (its downlink still applies), or wrap "
                "the strategy with secure(...) alone")
    return mean_refusal(strategy)  # the weighted mean, then (FedAvgM, the server optimizers) a step from it


class SecureStrategy(LayeredStrategy):
    """``strategy`` over securely aggregated updates (the ClientApp needs
    :func:`fedge.edge_client.secure_mod`). ``secure_aggregation`` is Fedge's spec (docs/settings.md, ``secure-aggregation``);
    ``differential_privacy="gaussian:noise=z,clip=C,..."``: distributed DP, the devices add the noise
    inside the ring, and nodes are Poisson-sampled at the strategy's ``fraction_train``."""

    #: what another wrapper asks before it wraps this one: updates leave the devices masked
    masks_updates = True

    def __init__(self, strategy: Strategy, secure_aggregation: str = "secagg:bits=8,clip=0.2,weight-cap=256",
                 seed: int = 0, differential_privacy: str = "none") -> None:
        #: what was wrapped (``distributed_dp`` wraps it again)
        self.wrapped = strategy
        layers: list[Layer] = []
        uplink = None
        if isinstance(strategy, LayeredStrategy) and not strategy.masks_updates:  # one round
            strategy, layers, uplink = strategy.strategy, list(strategy.layers), strategy.uplink
        reason = refuse_reason(strategy, layers, uplink)
        if reason is not None:
            raise ValueError(f"secure aggregation cannot wrap {type(strategy).__name__}: {reason}")
        spec = required_spec(parse_secure_aggregation, secure_aggregation, "secure_aggregation")
        self.spec, self.seed = spec, int(seed)
        #: distributed DP: the devices add Skellam noise inside the ring
        self.dp: DifferentialPrivacyLayer | None = None
        if differential_privacy and differential_privacy.strip().lower() != "none":
            dp_spec = required_spec(parse_differential_privacy, differential_privacy, "differential_privacy")
            rate = float(getattr(strategy, "fraction_train", 0.0))
            if not 0 < rate <= 1:
                raise ValueError(f"Poisson sampling needs the strategy's fraction_train in (0, 1], got {rate}")
            try:
                self.dp = DifferentialPrivacyLayer.distributed(dp_spec, lambda connected: rate)
            except ValueError as err:
                raise ValueError(f"differential_privacy {differential_privacy!r}: {err}") from None
        #: the run id, the identity pins (trust on first use) and each round's flow, shared with Fedge's engine
        self.session = SecureSession(spec, self.seed)
        #: the weight a device reports (under DP every device weighs 1: none)
        self.weight_key = "" if self.dp is not None else str(getattr(strategy, "weighted_by_key", ""))
        layer = SecureAggregation(self.session, weighted=bool(self.weight_key),
                                  dp_spec=None if self.dp is None else self.dp.spec, weight_key=self.weight_key)
        self._wrap(strategy, [*layers, layer] + ([self.dp] if self.dp is not None else []))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.dp is not None and not self.dp.mechanism.numel:  # the noise is sized by the model, before the sample
            self.dp.mechanism.numel = Layout(arrays).numel
        return super().configure_train(server_round, arrays, config, grid)

    def describe(self) -> str:
        return f"secure aggregation: {self.spec.spec}"


def distributed_dp(strategy: Strategy, differential_privacy: str) -> SecureStrategy:
    """Distributed DP as a wrapper of its own: ``distributed_dp(secure(FedAvg(...)), "gaussian:noise=z,
    clip=C,...")`` is ``secure(FedAvg(...), differential_privacy=...)``. The devices add the noise
    inside secure aggregation's ring, so only a ``secure(...)`` can carry it; anything else is
    refused here, with the reason."""
    if not isinstance(strategy, SecureStrategy):
        raise ValueError(f"distributed DP adds its noise inside secure aggregation's ring: wrap secure(...) first, "
                         f"distributed_dp(secure({type(strategy).__name__}(...)), ...); for central DP, layered(strategy, "
                         "DifferentialPrivacyLayer.central(...)) (fedge.coordinator.dp_layer)")
    if strategy.dp is not None:
        raise ValueError("this secure(...) already carries distributed DP")
    return SecureStrategy(strategy.wrapped, strategy.spec.spec, strategy.seed, differential_privacy)


#: ``secure(strategy, secure_aggregation="secagg:bits=8,clip=0.2,weight-cap=256", seed=0,
#: differential_privacy="none")``
secure = SecureStrategy
