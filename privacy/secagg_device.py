"""A device's side of one secure-aggregation round (SecAgg+, semi-honest, with signed advertisements).

Stages, each answering one message of the coordinator:

1. ``advertise``: two fresh X25519 public keys and a commitment to a fresh self-mask seed, signed.
2. ``share_keys``: checks every neighbour's advertisement against its identity key, then deals
   t-of-k Shamir shares of its seed and of its ``s`` private key, sealed for each neighbour.
3. ``masked_input``: opens the shares addressed to it (an altered one is refused), and uploads its
   levels plus its self mask plus one pairwise mask per neighbour that dealt shares (added for the
   lower id, subtracted for the higher), mod 2^r. The pairwise masks cancel in the sum.
4. ``consistency`` (only when the plan says the coordinator may lie): signs the survivor set.
5. ``unmask``: for each neighbour, discloses the seed share if that neighbour's upload arrived, or
   the key share if it did not, never both: the coordinator learns only the sum. Under the
   consistency check it first needs valid signatures over the same set from a quorum.

Every stage runs under the plan the device advertised for: its digest is signed into the
advertisement and kept with the state, and a later stage under another plan is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedge.privacy.consistency import check_quorum, sign_survivors
from fedge.privacy.errors import AdvertisementError, ConsistencyError, ProtocolError, UnmaskError
from fedge.privacy.keys import (
    AD_BYTES,
    KeyAdvertisement,
    derive_key,
    private_bytes,
    public_bytes,
    seed_commitment,
    x25519_from_private_bytes,
)
from fedge.privacy.messages import KEY, SEED, Reveal, encode_masked, encode_reveals, open_shares, seal_shares
from fedge.privacy.plan import SecAggPlan
from fedge.privacy.prg import mask
from fedge.privacy.ring import ring_mask
from fedge.privacy.shamir import split_secret

__all__ = ["SecAggDevice", "export_state", "pair_mask_seed", "restore_state", "state_round"]

_ORDER = ("advertise", "share_keys", "masked_input", "consistency", "unmask", "done")


def pair_mask_seed(plan: SecAggPlan, private: X25519PrivateKey, peer_public: bytes, a: int, b: int) -> bytes:
    """The pairwise mask seed of devices ``a`` and ``b`` (symmetric: both sides derive the same)."""
    low, high = sorted((a, b))
    return derive_key(private, peer_public, plan.context.label(b"pair-mask", low, high))


def _share_key(plan: SecAggPlan, private: X25519PrivateKey, peer_public: bytes, a: int, b: int) -> bytes:
    low, high = sorted((a, b))
    return derive_key(private, peer_public, plan.context.label(b"share-key", low, high))


class SecAggDevice:
    """One device in one round. Make a new one every round: keys and seeds are never reused."""

    def __init__(self, plan: SecAggPlan, node: int, identity: Ed25519PrivateKey) -> None:
        self.plan = plan
        self.node = node
        self._peers = plan.neighbours_of(node)
        self._identity = identity
        self._c = X25519PrivateKey.generate()
        self._s = X25519PrivateKey.generate()
        self._seed = os.urandom(32)
        self._stage = 0
        self._ads: dict[int, KeyAdvertisement] = {}
        self._identities: dict[int, bytes] = {}  # neighbours' identity keys, as checked at share_keys
        self._held: dict[int, tuple[bytes, bytes]] = {}
        self._survivors: tuple[int, ...] = ()  # the set this device signed (consistency check)

    def _enter(self, stage: str) -> None:
        if stage == "unmask" and not self.plan.consistency and _ORDER[self._stage] == "consistency":
            self._stage += 1  # no consistency check in this plan: straight to unmasking
        if _ORDER[self._stage] != stage:
            raise ProtocolError(f"device {self.node}: {stage} called at stage {_ORDER[self._stage]}")
        self._stage += 1

    def advertise(self) -> KeyAdvertisement:
        self._enter("advertise")
        return KeyAdvertisement.create(self.plan.context, self.node, self._identity, public_bytes(self._c.public_key()),
                                       public_bytes(self._s.public_key()),
                                       seed_commitment(self.plan.context, self.node, self._seed),
                                       plan_digest=self.plan.digest)

    def share_keys(self, advertisements: Mapping[int, KeyAdvertisement],
                   identities: Mapping[int, Ed25519PublicKey]) -> dict[int, bytes]:
        """Sealed shares for every neighbour whose advertisement checks out, keyed by neighbour."""
        self._enter("share_keys")
        for node, ad in advertisements.items():
            if node != ad.node:
                raise AdvertisementError(f"an advertisement of device {ad.node} was delivered as device {node}'s")
            if node not in self._peers:
                raise AdvertisementError(f"device {node} is not a neighbour of device {self.node} in this round")
            ad.verify(self.plan.context, identities.get(node), plan_digest=self.plan.digest)
        self._ads = dict(advertisements)
        self._identities = {node: identities[node].public_bytes_raw() for node in self._ads}
        threshold = self.plan.reconstruction_threshold
        if len(self._ads) < threshold:
            raise UnmaskError(f"device {self.node}: {len(self._ads)} neighbours advertised keys, fewer than "
                              f"the threshold {threshold}; the round cannot be unmasked")
        seed_shares = split_secret(self._seed, threshold, len(self._peers))
        key_shares = split_secret(private_bytes(self._s), threshold, len(self._peers))
        sealed = {}
        for position, peer in enumerate(self._peers):
            if peer not in self._ads:
                continue
            key = _share_key(self.plan, self._c, self._ads[peer].c_public, self.node, peer)
            sealed[peer] = seal_shares(key, self.plan.context, self.node, peer, seed_shares[position],
                                       key_shares[position])
        return sealed

    def masked_input(self, sealed: Mapping[int, bytes], levels: np.ndarray) -> bytes:
        """The masked upload. ``sealed``: the shares neighbours dealt to this device, keyed by dealer."""
        self._enter("masked_input")
        levels = np.asarray(levels)
        if levels.shape != (self.plan.length,):
            raise ProtocolError(f"device {self.node}: {levels.shape} levels, the round expects ({self.plan.length},)")
        top = (1 << self.plan.bits) - 1 if self.plan.noise is not None else self.plan.grid.top
        if levels.size and (levels.min() < 0 or levels.max() > top):
            raise ProtocolError(f"device {self.node}: levels outside [0, {top}]")
        for dealer, blob in sealed.items():
            if dealer not in self._ads:
                raise ProtocolError(f"device {self.node} got shares from device {dealer}, which it has no keys of")
            key = _share_key(self.plan, self._c, self._ads[dealer].c_public, dealer, self.node)
            self._held[dealer] = open_shares(key, self.plan.context, dealer, self.node, blob)
        if len(self._held) < self.plan.reconstruction_threshold:
            raise UnmaskError(f"device {self.node}: shares from {len(self._held)} neighbours, fewer than the "
                              f"threshold {self.plan.reconstruction_threshold}")
        bits, count = self.plan.bits, self.plan.length
        masked = levels.astype(np.uint32) + mask(self._seed, count, bits)
        for peer in sorted(self._held):  # the neighbours that dealt shares are the ones the coordinator counts
            pair = mask(pair_mask_seed(self.plan, self._s, self._ads[peer].s_public, self.node, peer), count, bits)
            if self.node < peer:
                masked += pair
            else:
                masked -= pair
        masked &= ring_mask(bits)
        return encode_masked(self.node, masked, bits)

    def _check_survivors(self, survivors: Sequence[int]) -> set[int]:
        alive = set(survivors)
        if self.node not in alive:
            raise UnmaskError(f"device {self.node} is asked to unmask a round its own upload is not part of")
        strangers = alive - set(self.plan.participants)
        if strangers:
            raise UnmaskError(f"survivors {sorted(strangers)} are not participants of this round")
        # Per neighbourhood (SecAgg+, Bell et al. 2020): the masks this device's upload hides behind
        # are its neighbours'; with fewer than t of them surviving, a sparse graph's global count
        # could pass while the sum around this device reveals too little.
        neighbours_alive = len(alive.intersection(self._peers))
        if neighbours_alive < self.plan.reconstruction_threshold:
            raise UnmaskError(f"{neighbours_alive} of device {self.node}'s neighbours survived: fewer than the "
                              f"threshold {self.plan.reconstruction_threshold}, the sum would reveal too little")
        return alive

    def consistency(self, survivors: Sequence[int]) -> bytes:
        """This device's signature over the survivor set it was shown (it signs one set per round)."""
        if not self.plan.consistency:
            raise ProtocolError("this round's plan has no consistency check")
        self._enter("consistency")
        self._check_survivors(survivors)
        self._survivors = tuple(sorted(set(survivors)))
        return sign_survivors(self._identity, self.plan, self._survivors)

    def unmask(self, survivors: Sequence[int], signatures: Mapping[int, bytes] | None = None,
               identities: Mapping[int, Ed25519PublicKey] | None = None) -> bytes:
        """Reveal, for each neighbour that dealt shares, its seed share (it survived) or its key share
        (it dropped). Under the consistency check, only for the set this device signed, and only with
        a quorum's valid signatures over it (``identities``: the signers' keys, checked by the caller;
        a neighbour's must be the one it had at ``share_keys``)."""
        self._enter("unmask")
        alive = self._check_survivors(survivors)
        if self.plan.consistency:
            self._stage = len(_ORDER) - 1  # whatever happens below, this round reveals at most once
            if tuple(sorted(alive)) != self._survivors:
                raise ConsistencyError(f"device {self.node} signed another survivor set than the one it is "
                                       "asked to unmask for")
            identities = dict(identities or {})
            for node, raw in self._identities.items():
                if node in identities and identities[node].public_bytes_raw() != raw:
                    raise ConsistencyError(f"device {node}'s identity changed since it advertised keys")
            check_quorum(self.plan, self._survivors, signatures or {}, identities)
        reveals = [Reveal(dealer, SEED, seed_share) if dealer in alive else Reveal(dealer, KEY, key_share)
                   for dealer, (seed_share, key_share) in sorted(self._held.items())]
        return encode_reveals(reveals)


def _state_key(name: str) -> str:
    return f"secagg-{name}"


def export_state(device: SecAggDevice) -> dict[str, bytes | int]:
    """What a device must keep between the stages' messages (Flower hands a handler only ``context.state``)."""
    held = b"".join(dealer.to_bytes(8, "little") + seed + key for dealer, (seed, key) in sorted(device._held.items()))
    ads = b"".join(ad.to_bytes() for _, ad in sorted(device._ads.items()))
    identities = b"".join(node.to_bytes(8, "little") + raw for node, raw in sorted(device._identities.items()))
    survivors = b"".join(node.to_bytes(8, "little") for node in device._survivors)
    return {_state_key("plan"): device.plan.digest, _state_key("identities"): identities,
            _state_key("survivors"): survivors,
            _state_key("c"): private_bytes(device._c), _state_key("s"): private_bytes(device._s), _state_key("seed"): device._seed,
            _state_key("stage"): device._stage, _state_key("ads"): ads, _state_key("held"): held,
            _state_key("round"): device.plan.context.round, _state_key("run"): device.plan.context.run_id}


def state_round(state: Mapping[str, bytes | int]) -> tuple[bytes, int] | None:
    """(run id, round) of a state :func:`export_state` made; None for anything else."""
    run, number = state.get(_state_key("run")), state.get(_state_key("round"))
    if not isinstance(run, (bytes, bytearray)) or not isinstance(number, int):
        return None
    return bytes(run), number


def restore_state(plan: SecAggPlan, node: int, identity: Ed25519PrivateKey,
                  state: Mapping[str, bytes | int]) -> SecAggDevice:
    """The device of :func:`export_state`, checked to belong to this plan's round, under this very plan."""
    if state.get(_state_key("round")) != plan.context.round or state.get(_state_key("run")) != plan.context.run_id:
        raise ProtocolError(f"device {node} holds no secure-aggregation state for round {plan.context.round}")
    if bytes(state.get(_state_key("plan"), b"")) != plan.digest:
        raise ProtocolError(f"device {node}: round {plan.context.round}'s plan changed since this device advertised "
                            "its keys (participants, threshold, grid or ring); refused")
    device = SecAggDevice.__new__(SecAggDevice)
    device.plan, device.node, device._identity = plan, node, identity
    device._peers = plan.neighbours_of(node)
    device._c = x25519_from_private_bytes(bytes(state[_state_key("c")]))
    device._s = x25519_from_private_bytes(bytes(state[_state_key("s")]))
    device._seed = bytes(state[_state_key("seed")])
    device._stage = int(state[_state_key("stage")])
    ads, size = bytes(state[_state_key("ads")]), AD_BYTES
    device._ads = {ad.node: ad for ad in (KeyAdvertisement.from_bytes(ads[i:i + size]) for i in range(0, len(ads), size))}
    held, record = bytes(state[_state_key("held")]), 8 + 64
    device._held = {int.from_bytes(held[i:i + 8], "little"): (held[i + 8:i + 40], held[i + 40:i + 72])
                    for i in range(0, len(held), record)}
    ids = bytes(state[_state_key("identities")])
    device._identities = {int.from_bytes(ids[i:i + 8], "little"): ids[i + 8:i + 40] for i in range(0, len(ids), 40)}
    alive = bytes(state[_state_key("survivors")])
    device._survivors = tuple(int.from_bytes(alive[i:i + 8], "little") for i in range(0, len(alive), 8))
    return device
