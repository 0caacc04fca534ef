"""A run's secure aggregation on a coordinator, written once for both of Fedge's adapters.

Fedge's engine (``server/engine/layers/__init__.py``) and a user's ServerApp
(``fedge.flower.secure``) run the same flow around each round's train messages: open the round
among the sampled nodes (stages 1 and 2; only the nodes that dealt their shares train), staple each
train message with its plan and shares, take each masked upload after checking it against the
plan, and reveal the survivors' sum (stage 4). What binds the rounds together also lives here, not
in each adapter: the run id every signature and share is bound to, the identity pins (trust on
first use), and the operator's issuer, read afresh each round so a revocation takes effect without
a restart. The adapters keep only what differs: how a stage reaches the devices (the engine's
dispatcher or the user's ``Grid``), and what a failed round means to their caller.
"""

from __future__ import annotations

import os
from typing import Any

from fedge.privacy.credentials import load_issuer
from fedge.privacy.distributed_dp import SkellamParams
from fedge.privacy.spec import SecAggSpec
from fedge.coordinator.secure_round import SecureRound

__all__ = ["SecureSession"]


class SecureSession:
    """Secure aggregation across one run's rounds: ``round()`` opens each one."""

    def __init__(self, spec: SecAggSpec, seed: int, run_id: bytes | None = None) -> None:
        self.spec, self.seed = spec, int(seed)
        #: every signature and share of this run is bound to it; random, so that no other run (a
        #: rerun with the same seed and directory name included) shares it; kept in the checkpoint
        self.run_id = run_id if run_id is not None else os.urandom(16)
        #: each node's identity key, pinned the first time it takes part
        self.pins: dict[int, bytes] = {}
        #: the operator CA's key when identities must be issued (``issuer=``); None: trust on first use.
        #: Loaded here so that a missing or bad CA file is refused before the run (CredentialError).
        self.issuer: Any = load_issuer(spec.issuer) if spec.issuer else None
        #: the highest revocation-list serial seen (kept in the checkpoint): an older list is refused
        self.revocation_serial = self.issuer.serial if self.issuer is not None else 0

    def round(self, number: int, nodes: list[int], numel: int, *, weighted: bool,
              noise: SkellamParams | None = None) -> SecureRound:
        """Round ``number`` among ``nodes`` (not yet opened: :meth:`SecureRound.open`). With an
        issuer, its revocations as they stand now: a revoked device is out from this round on."""
        if self.spec.issuer:
            self.issuer = load_issuer(self.spec.issuer, self.revocation_serial)
            self.revocation_serial = self.issuer.serial
        return SecureRound(self.spec, self.run_id, self.seed, number, nodes, numel, self.pins, weighted=weighted,
                           issuer=self.issuer, noise=noise)

    def state_dict(self) -> dict[str, Any]:
        return {"run-id": self.run_id.hex(), "pins": {str(node): raw.hex() for node, raw in sorted(self.pins.items())},
                "revocation-serial": self.revocation_serial}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A resumed run keeps its run id and its identity pins (a checkpoint from before they were
        kept gets a fresh id and no pins); raises ValueError on a malformed one."""
        if state is None:
            return
        raw = bytes.fromhex(str(state.get("run-id", "")))
        if len(raw) != 16:
            raise ValueError("the checkpoint's secure-aggregation run id is not 16 bytes")
        pins = {}
        for node, key in dict(state.get("pins", {})).items():
            pin = bytes.fromhex(str(key))
            if len(pin) != 32:
                raise ValueError(f"the checkpoint's identity pin of node {node} is not 32 bytes")
            pins[int(node)] = pin
        serial = state.get("revocation-serial", 0)
        if not isinstance(serial, int) or isinstance(serial, bool) or serial < 0:
            raise ValueError(f"the checkpoint's revocation serial {serial!r} is not a whole number >= 0")
        self.run_id = raw
        self.pins.clear()
        self.pins.update(pins)
        self.revocation_serial = max(self.revocation_serial, serial)
