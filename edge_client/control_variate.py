"""A device's SCAFFOLD control variate ``c_i``: what Fedge's own SCAFFOLD handler and a Flower app's
``scaffold_mod`` both keep and send (the rules: ``fedge.aggregation.scaffold``).

``c_i`` lives in the node's store between rounds, as error-feedback memory does; a device that has
never taken part starts from zero (the paper's initialisation). The server's ``c`` arrives in the
train message's ``CONTROL_RECORD``, encoded with the codec its config names
(``SCAFFOLD_CONTROL_CODEC``); the change ``dc_i`` goes back in the reply's ``CONTROL_RECORD``,
encoded with that codec through an error-feedback memory of its own, so the coordinator's sum of
the changes tracks the exact ones over the rounds.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Message

from fedge.aggregation.scaffold import control_step
from fedge.compression import PayloadError, make_codec
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.update_encoder import encode_update
from fedge.protocol.config_keys import SCAFFOLD_CONTROL_CODEC
from fedge.protocol.records import CONFIG_RECORD, CONTROL_RECORD, PAYLOAD_KEY, ProtocolError, payload_array, read_payload
from fedge.tasks import unflatten_state

__all__ = ["ControlVariate", "carries_control"]


def carries_control(msg: Message) -> bool:
    """Whether ``msg`` is a SCAFFOLD train message (it brings the server's control variate)."""
    return msg.metadata.message_type.startswith("train") and CONTROL_RECORD in msg.content.array_records


class ControlVariate:
    """This node's ``c_i`` for one message: the server's ``c`` read from it, ``c - c_i`` for the
    local steps, then :meth:`reply` with the change, which keeps the new ``c_i``."""

    def __init__(self, msg: Message, store: NodeStore, numel: int) -> None:
        config = msg.content.config_records.get(CONFIG_RECORD)
        spec = None if config is None else config.get(SCAFFOLD_CONTROL_CODEC)
        if not isinstance(spec, str) or not spec:
            raise ProtocolError(f"a SCAFFOLD message names its control codec in config[{SCAFFOLD_CONTROL_CODEC!r}]")
        self.spec, self.store = spec, store
        try:
            self.codec = make_codec(spec)
            self.server = self.codec.decode(read_payload(msg.content, CONTROL_RECORD), numel)
        except PayloadError as err:
            raise ProtocolError(f"scaffold: the server's control variate: {err}") from None
        own = store.get_tensor("control")
        self.own = own if own is not None and own.numel() == numel else torch.zeros(numel)

    @property
    def correction(self) -> torch.Tensor:
        """``c - c_i``, flat: what each local step is moved by (times the learning rate)."""
        return self.server - self.own

    def by_parameter(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``c - c_i`` split over ``model``'s parameters by name (the flat vector is its state dict's
        floating-point tensors in order, as every flat model here is)."""
        parameters = dict(model.named_parameters())
        return {name: value for name, value in unflatten_state(self.correction, model.state_dict()).items()
                if name in parameters}

    def reply(self, delta: torch.Tensor, steps: int, lr: float, *, server_round: int, seed: int,
              generator: torch.Generator | None = None) -> ArrayRecord:
        """The record of ``dc_i`` for ``delta = y - x`` after ``steps`` local steps at ``lr``; the new
        ``c_i`` is kept (call once the update itself is encoded)."""
        new, change = control_step(self.own, self.server, delta, steps, lr)
        payload, _ = encode_update(change, self.codec, self.store.child("memory"), server_round=server_round,
                                   seed=seed, error_feedback=True, generator=generator)
        self.store.put_tensor("control", new)
        self.own = new
        return ArrayRecord({PAYLOAD_KEY: payload_array(payload)})
