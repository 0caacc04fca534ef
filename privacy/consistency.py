"""SecAgg's consistency check (Bonawitz et al. 2017, round 3): every device that will unmask signs
the survivor set it was shown, and reveals nothing until it holds valid signatures over *that same
set* from a quorum of the round's participants.

Why: a coordinator that may lie could tell one neighbour of device X that X survived (and collect
X's seed share) and another that X dropped (and collect X's key share), then unmask X's update
alone. An honest device signs one set per round, and two sets cannot each gather signatures from a
strict majority of the participants, so every honest device that reveals was shown the same set.
A device refuses the whole batch if any signature in it is invalid: a coordinator that forwards a
bad one is lying, not dropping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedge.privacy.errors import ConsistencyError
from fedge.privacy.plan import SecAggPlan

__all__ = ["survivor_message", "sign_survivors", "check_signature", "check_quorum"]

_SIGNATURE = 64


def survivor_message(plan: SecAggPlan, survivors: Sequence[int]) -> bytes:
    """What a device signs: this round's plan and the sorted survivor set."""
    ids = sorted(set(survivors))
    return plan.context.label(b"survivors", *ids) + plan.digest


def sign_survivors(identity: Ed25519PrivateKey, plan: SecAggPlan, survivors: Sequence[int]) -> bytes:
    return identity.sign(survivor_message(plan, survivors))


def check_signature(plan: SecAggPlan, survivors: Sequence[int], signer: int, signature: bytes,
                    identity: Ed25519PublicKey | None) -> None:
    """Raise :class:`ConsistencyError` unless ``signer`` signed exactly ``survivors`` for this plan."""
    if identity is None:
        raise ConsistencyError(f"device {signer}'s signature over the survivors comes without its identity key")
    if len(signature) != _SIGNATURE:
        raise ConsistencyError(f"device {signer}'s signature over the survivors is {len(signature)} bytes")
    try:
        identity.verify(bytes(signature), survivor_message(plan, survivors))
    except InvalidSignature:
        raise ConsistencyError(f"device {signer} did not sign this survivor set: the coordinator showed "
                               "devices different sets, or altered a signature") from None


def check_quorum(plan: SecAggPlan, survivors: Sequence[int], signatures: Mapping[int, bytes],
                 identities: Mapping[int, Ed25519PublicKey]) -> None:
    """A device's check before it reveals anything: every signature valid, every signer a survivor,
    and a strict majority of the participants among them."""
    alive = set(survivors)
    strangers = sorted(set(signatures) - alive)
    if strangers:
        raise ConsistencyError(f"signatures over the survivor set from devices outside it: {strangers}")
    seen: dict[bytes, int] = {}
    for signer, signature in signatures.items():
        identity = identities.get(signer)
        check_signature(plan, survivors, signer, signature, identity)
        raw = identity.public_bytes_raw()  # type: ignore[union-attr]
        if raw in seen:  # one device's signature must not count twice under two node ids
            raise ConsistencyError(f"devices {seen[raw]} and {signer} present the same identity key")
        seen[raw] = signer
    if len(signatures) < plan.consistency_quorum:
        raise ConsistencyError(f"{len(signatures)} devices signed the survivor set, fewer than the quorum "
                               f"{plan.consistency_quorum} of {len(plan.participants)} participants")
