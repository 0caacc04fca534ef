"""Stochastic controlled averaging: ``algorithm = "scaffold[:control-bits=8]"``.

SCAFFOLD (Karimireddy et al., ICML 2020; the rules in ``fedge.aggregation.scaffold``) corrects each
device's local steps by ``c - c_i`` so that skewed devices stop drifting toward their own optimum.

- ``c_i`` is device state: each device keeps its own between rounds (``fedge.edge_client.algorithms.
  scaffold``, in its node store beside its error-feedback memory) and sends its change ``dc_i`` as a
  second payload in its update record (``CONTROL_KEY``), encoded with the run's codec through an
  error-feedback memory of its own.
- ``c`` is this coordinator's state: every train message carries it in ``CONTROL_RECORD``, encoded
  once per round through a server-side error-feedback residual (a snapshot each round, so a device
  that missed rounds needs no catch-up): fp32 when the run's codec is ``none``, otherwise QSGD at
  ``control-bits`` bits (buckets of 512, max norm). A sparsifier would send a state as mostly
  zeros, so the snapshot is always a dense quantizer.
- The model moves by the sampled devices' plain mean of ``dy`` (the paper's Algorithm 1 and
  NIID-Bench: not weighted by examples), through the run's server optimizer; ``c`` moves by
  ``(1/N) sum dc_i`` with ``N`` the devices connected when the round opened.

A reply whose control payload is missing or does not decode (length, codec, finiteness) is refused
before either sum takes anything from it. Secure aggregation, differential privacy and robust
aggregators are refused: each would combine the two payloads differently or not per device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, RecordDict

from fedge.aggregation.exact_sum import ExactSum
from fedge.aggregation.scaffold import server_control
from fedge.compression import PayloadError, make_codec
from fedge.compression.codec import Codec
from fedge.compression.error_feedback import ErrorFeedback
from fedge.protocol import (
    CONTROL_KEY,
    CONTROL_RECORD,
    PAYLOAD_KEY,
    UPDATE_RECORD,
    ProtocolError,
    payload_array,
)
from fedge.protocol.config_keys import SCAFFOLD_CONTROL_CODEC
from fedge.protocol.records import payload_bytes
from fedge.server.algorithms.fedavg import FedAvg, FedAvgStep
from fedge.server.engine.algorithm import Outgoing, Rejected, RunContext, Step, StepOutcome, Update
from fedge.server.settings import SettingsError
from fedge.tasks import tensor_sizes


__all__ = ["Scaffold", "control_codec_spec"]


def control_codec_spec(uplink: str, bits: int) -> str:
    """The codec of the server's control variate going down: fp32 for an fp32 run, else QSGD."""
    return "none" if uplink == "none" else f"qsgd:bits={bits},bucket=512,norm=max"


@dataclass
class ScaffoldStep(FedAvgStep):
    controls: ExactSum | None = None
    #: the control payload this round's messages carry (encoded once, whatever the messages)
    sent: bytes | None = None
    taken: int = 0
    refused: list[int] = field(default_factory=list)


class Scaffold(FedAvg):
    name = "scaffold"
    device_handler = "scaffold"
    # not prox-mu (the correction replaces the proximal pull), not aggregator (a robust rule would
    # choose among dy that no longer match the dc summed beside them)
    settings_used = frozenset({"server-opt", "downlink-codec", "model-average"})

    def __init__(self, ctx: RunContext, control_bits: int = 8) -> None:
        super().__init__(ctx)
        s = ctx.settings
        refused = [f"{key}={value!r}" for key, value, default in (
            ("secure-aggregation", s.secure_aggregation, "none"),
            ("differential-privacy", s.differential_privacy, "none")) if value != default]
        if refused:
            raise SettingsError(f"scaffold needs each device's update and control change on their own: "
                                f"{', '.join(refused)} is not possible with it")
        if not 1 <= int(control_bits) <= 16:
            raise SettingsError(f"scaffold control-bits must be in 1..16, got {control_bits!r}")
        self.control_bits = int(control_bits)
        self.control_spec = control_codec_spec(s.codec, self.control_bits)
        self.control_codec: Codec = make_codec(self.control_spec).for_model(tensor_sizes(ctx.template))
        self.control = torch.zeros(ctx.numel)
        self.control_memory = ErrorFeedback(self.control_codec, ctx.numel)

    @property
    def spec(self) -> str:
        return f"scaffold:control-bits={self.control_bits}"

    def open_step(self, number: int, nodes: list[int]) -> ScaffoldStep:
        base = super().open_step(number, nodes)
        return ScaffoldStep(number, list(nodes), aggregate=base.aggregate, controls=ExactSum(self.ctx.numel))

    def configure(self, step: Step, nodes: list[int]) -> list[Outgoing]:
        assert isinstance(step, ScaffoldStep)
        if step.sent is None:  # one snapshot of c per round, through the server's error feedback
            step.sent = self.control_memory.encode(self.control)
        outgoing = self.model_messages(nodes, self.round_config(step.number, **{
            SCAFFOLD_CONTROL_CODEC: self.control_spec}), self.params)
        for o in outgoing:
            o.content[CONTROL_RECORD] = ArrayRecord({PAYLOAD_KEY: payload_array(step.sent)})
        return outgoing

    def control_change(self, step: Step, content: RecordDict) -> torch.Tensor:
        """A reply's ``dc_i``, decoded and checked (:class:`Rejected` naming what is wrong)."""
        record = content.array_records.get(UPDATE_RECORD)
        if record is None or CONTROL_KEY not in record:
            raise Rejected(f"scaffold: the reply has no {CONTROL_KEY!r} payload in its {UPDATE_RECORD!r} record")
        try:
            return self.wire(step.number).decode(payload_bytes(record[CONTROL_KEY], CONTROL_KEY), self.ctx.numel)
        except (PayloadError, ProtocolError) as err:
            raise Rejected(f"scaffold: control change: {err}") from None

    def absorb(self, step: Step, update: Update) -> None:
        assert isinstance(step, ScaffoldStep) and step.controls is not None
        change = self.control_change(step, update.content)  # refused before either sum takes anything
        step.aggregate.add(update.vector, 1.0)  # the sampled devices' plain mean (Algorithm 1, line 16)
        step.loss_sum.add(update.train_loss)
        step.loss_weight.add(1.0)
        step.used.append(update.node)
        step.controls.add(change)
        step.taken += 1

    def close(self, step: Step) -> StepOutcome:
        assert isinstance(step, ScaffoldStep) and step.controls is not None
        before = self.params
        outcome = super().close(step)
        if self.params is not before:  # the model moved this round: so does c (line 17)
            population = max(step.connected, step.taken)
            self.control = server_control(self.control, step.controls.value(), population)
        outcome.extra.update({"control_norm": float(self.control.norm()), "control_bits": self.control_bits})
        return outcome

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "algorithm": self.spec, "control_codec": self.control_spec}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "control": self.control.clone(),
                "control_residual": self.control_memory.residual.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.control = self.check_flat(state.get("control"), "SCAFFOLD server control variate")
        self.control_memory = ErrorFeedback(self.control_codec, self.ctx.numel,
                                            self.check_flat(state.get("control_residual"), "SCAFFOLD control residual"))
