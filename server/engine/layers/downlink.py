"""The downlink in Fedge's engine (``downlink-codec``): the layer both coordinators run
(``fedge.coordinator.downlink_layer``), built from the run's settings, and what those settings refuse.

The lattice's base is the task's seeded initial model, which every device builds, or, for a run from
a model file (``init``), that file's weights, shipped once with each device's first snapshot.
Algorithms know none of it: a message whose :attr:`Outgoing.model` is set gets that model.
"""

from __future__ import annotations

from flwr.app import ArrayRecord

from fedge.coordinator.downlink_layer import DownlinkLayer as SharedDownlink, uplink_refusal
from fedge.server.engine.algorithm import Algorithm
from fedge.server.settings import SettingsError
from fedge.tasks import flatten_state, seeded_initial_params, tensor_sizes, unflatten_state

__all__ = ["DownlinkLayer"]


class DownlinkLayer(SharedDownlink):
    """The engine's downlink: the shared layer with the task's base."""

    @classmethod
    def build(cls, algorithm: Algorithm, run_dir: object = None) -> DownlinkLayer:
        """Every run has one (``none`` ships full models); a malformed spec is refused here."""
        ctx, s = algorithm.ctx, algorithm.ctx.settings
        shares_support = ctx.codec.shares_support
        # EASGD's devices run FedAvg's handler but send the difference of their own model
        own_models = any(layer.key == "easgd" for layer in algorithm.layers())
        if shares_support and ((algorithm.device_handler or algorithm.name) != "fedavg" or own_models):
            raise SettingsError(f"codec {s.codec!r} sends on the support of the model change each device received; "
                                f"{algorithm.name}'s devices do not send an update from that model (FedAvg, FedProx "
                                "and FedBuff do)")
        template = ctx.template
        try:
            layer = cls(s.downlink_codec, track_supports=shares_support,
                        full_record=lambda params: ArrayRecord(unflatten_state(params, template)))
        except ValueError as err:
            raise SettingsError(f"downlink-codec: {err}") from None
        reason = uplink_refusal(ctx.codec, layer)
        if reason is not None:
            raise SettingsError(f"codec {s.codec!r} {reason} (downlink-codec = \"lattice:...\")")
        if layer.parsed is not None:  # from a model file, the base is that model (shipped, set in start())
            base = flatten_state(template) if s.init else seeded_initial_params(ctx.task, s.seed)
            layer.begin(base, tensor_sizes(template), seeded=not s.init)
            if s.init:
                layer.ship_start()
        return layer
