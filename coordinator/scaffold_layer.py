"""SCAFFOLD's server side as a layer (Karimireddy et al., ICML 2020; the rules in
``fedge.aggregation.scaffold``): the one implementation both coordinators run.

Fedge's engine adds it for ``algorithm = "scaffold"`` (FedAvg with this layer and the devices'
SCAFFOLD handler); a Flower app wraps its strategy, ``layered(FedAvg(), ControlVariates())``, with
``scaffold_mod`` on its ClientApp and ``scaffold_correction(model, lr)`` called after each optimizer
step of its training loop.

- ``outgoing``: every train message carries the server's control variate ``c`` in
  ``CONTROL_RECORD``, one snapshot a round encoded through a server-side error-feedback residual
  (so a device that missed rounds needs no catch-up): fp32 with ``bits=0``, else QSGD at ``bits``
  (buckets of 512, max norm); the codec is named in the message's config.
- ``update``: each reply's ``dc_i`` (its ``CONTROL_RECORD``) is decoded and checked (length, codec,
  finiteness; given the devices' ``lr``, a norm no local steps could make from the reply's update:
  ``|dc_i| <= |c| + |dy| / lr`` by option II, twice that allowed) before anything is summed: a reply
  without a valid one is refused (``invalid``);
  every update then weighs the same (the paper's and NIID-Bench's mean over the sampled devices).
- ``close``: ``c <- c + (1/N) sum dc_i`` with ``N`` the devices connected when the step opened.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from flwr.app import ArrayRecord

from fedge.aggregation.exact_sum import ExactSum
from fedge.aggregation.scaffold import server_control
from fedge.compression import PayloadError, make_codec
from fedge.compression.error_feedback import ErrorFeedback
from fedge.protocol.config_keys import SCAFFOLD_CONTROL_CODEC
from fedge.protocol.failures import Rejected
from fedge.coordinator.layer import BOUNDED, Layer
from fedge.protocol.records import (
    CONFIG_RECORD,
    CONTROL_RECORD,
    PAYLOAD_KEY,
    ProtocolError,
    payload_array,
    read_payload,
)
from fedge.coordinator.step import Outgoing, Step, StepOutcome, Update
from fedge.coordinator.tally import Tally

__all__ = ["ControlVariates", "control_codec_spec"]


def control_codec_spec(bits: int) -> str:
    """The codec of the control variates both ways: fp32 (``bits=0``) or dense QSGD at ``bits``."""
    return "none" if bits == 0 else f"qsgd:bits={bits},bucket=512,norm=max"


class ControlVariates(Layer):
    key = "scaffold"
    needs = frozenset({BOUNDED})  # it reweighs what the guard has bounded

    def __init__(self, bits: int = 8, lr: float | None = None) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not (bits == 0 or 1 <= bits <= 16):
            raise ValueError(f"scaffold control bits must be 0 (fp32) or in 1..16, got {bits!r}")
        if lr is not None and not (isinstance(lr, (int, float)) and lr > 0):
            raise ValueError(f"scaffold lr must be > 0, got {lr!r}")
        self.bits, self.lr = bits, lr
        self.spec = control_codec_spec(bits)
        self.codec = make_codec(self.spec)
        self.control: torch.Tensor | None = None
        self.memory: ErrorFeedback | None = None

    def _begin(self, numel: int) -> None:
        self.control = torch.zeros(numel)
        self.memory = ErrorFeedback(self.codec, numel)

    def outgoing(self, step: Step, outgoing: list[Outgoing]) -> None:
        train = [o for o in outgoing if o.message_type.startswith("train")]
        if not train:
            return
        if self.control is None:  # a fresh run's first step: sized by the model the messages carry
            model = next((o.model for o in train if o.model is not None), None)
            if model is None:
                raise ProtocolError("scaffold: the train messages carry no model to size the control variate by")
            self._begin(model.numel())
        assert self.control is not None and self.memory is not None
        state = self.scratch(step, lambda: {"sent": self.memory.encode(self.control), "sum": None, "count": 0})
        for o in train:
            o.content[CONTROL_RECORD] = ArrayRecord({PAYLOAD_KEY: payload_array(state["sent"])})
            if CONFIG_RECORD in o.content.config_records:
                o.content.config_records[CONFIG_RECORD][SCAFFOLD_CONTROL_CODEC] = self.spec

    def change(self, update: Update) -> torch.Tensor:
        """The reply's ``dc_i``, decoded and checked (:class:`Rejected` says what is wrong)."""
        assert self.control is not None
        if CONTROL_RECORD not in update.content.array_records:
            raise Rejected(f"scaffold: the reply has no {CONTROL_RECORD!r} record (its control change)")
        try:
            return self.codec.decode(read_payload(update.content, CONTROL_RECORD), self.control.numel())
        except (PayloadError, ProtocolError) as err:
            raise Rejected(f"scaffold: control change: {err}") from None

    def update(self, step: Step, update: Update) -> Update:
        change = self.change(update)  # refused before either sum takes anything from the reply
        if self.lr is not None and self.control is not None:
            # option II: dc_i = -c - dy / (K lr) with K >= 1 steps, so |dc_i| <= |c| + |dy| / lr; twice
            # that leaves room for the encodings' error, and a forged change cannot blow c up
            bound = 2.0 * (float(self.control.norm()) + float(update.vector.norm()) / self.lr) + 1e-6
            if float(change.norm()) > bound:
                raise Rejected(f"scaffold: a control change of norm {float(change.norm()):.3g} is more than any "
                               f"local steps at lr {self.lr:g} make from this update (at most {bound:.3g})")
        state = self.scratch(step, lambda: {"sent": b"", "sum": None, "count": 0})
        if state["sum"] is None:
            state["sum"] = ExactSum(change.numel())
        state["sum"].add(change)
        state["count"] += 1
        return dataclasses.replace(update, weight=1.0)

    def close(self, step: Step, outcome: StepOutcome, tally: Tally) -> None:
        state = step.layers.get(self.key)
        if state is not None and state["count"] and outcome.model is not None and self.control is not None:
            population = max(step.connected, state["count"])
            self.control = server_control(self.control, state["sum"].value(), population)
        if self.control is not None:
            outcome.extra.update({"control_norm": float(self.control.norm()), "control_codec": self.spec})

    def describe(self) -> dict[str, Any]:
        return {"scaffold": {"control_codec": self.spec}}

    def state_dict(self) -> dict[str, Any] | None:
        if self.control is None or self.memory is None:
            return None
        return {"control": self.control.clone(), "residual": self.memory.residual.clone()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        control, residual = state.get("control"), state.get("residual")
        for name, value in (("control", control), ("residual", residual)):
            if not isinstance(value, torch.Tensor) or value.dim() != 1 or not torch.isfinite(value).all():
                raise ValueError(f"scaffold checkpoint: {name} is not a finite flat vector")
        if control.numel() != residual.numel():
            raise ValueError("scaffold checkpoint: control and residual differ in length")
        self.control = control.clone().to(torch.float32)
        self.memory = ErrorFeedback(self.codec, control.numel(), residual)

