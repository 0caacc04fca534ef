"""The coordinator's side of one secure-aggregation round: route, collect, and unmask only the sum.

The coordinator learns which devices took part at each stage (U1 advertised, U2 dealt shares, U3
uploaded, U4 revealed) and the sum over U3, nothing else. Every message is checked before it counts:
a bad advertisement or upload removes its device from the round (logged, like any bad reply), and
every reconstructed secret is checked against what its device signed (the seed commitment, the
``s`` public key), so a wrong share cannot silently corrupt the sum. With more shares than the
threshold, reconstruction tries other subsets before it gives up.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fedge.privacy.consistency import check_signature
from fedge.privacy.errors import ConsistencyError, ProtocolError, SecAggError, ShareError, UnmaskError
from fedge.privacy.keys import KeyAdvertisement, public_bytes, seed_commitment, x25519_from_private_bytes
from fedge.privacy.messages import KEY, SEED, decode_masked, decode_reveals
from fedge.privacy.plan import SecAggPlan
from fedge.privacy.prg import mask
from fedge.privacy.ring import ring_mask
from fedge.privacy.secagg_device import pair_mask_seed
from fedge.privacy.shamir import combine_secret

__all__ = ["SecAggServer"]

logger = logging.getLogger(__name__)
_MAX_SUBSETS = 64


class SecAggServer:
    """One round on the coordinator. ``refused`` maps each device dropped for a bad message to why."""

    def __init__(self, plan: SecAggPlan, identities: Mapping[int, Ed25519PublicKey]) -> None:
        self.plan = plan
        self._identities = dict(identities)
        self.refused: dict[int, str] = {}
        self._ads: dict[int, KeyAdvertisement] = {}
        self._routed: dict[int, set[int]] = {}  # holder -> dealers whose shares reached it
        self._masked: dict[int, np.ndarray] = {}
        self._dealers: set[int] = set()
        self.signatures: dict[int, bytes] = {}

    def _refuse(self, node: int, error: Exception) -> None:
        self.refused[node] = str(error)
        logger.warning("secure aggregation: device %d refused: %s", node, error)

    def receive_advertisements(self, advertisements: Mapping[int, bytes]) -> dict[int, dict[int, KeyAdvertisement]]:
        """U1, checked; returns for each device in U1 its neighbours' advertisements."""
        for node, blob in advertisements.items():
            try:
                self.plan.neighbours_of(node)
                ad = KeyAdvertisement.from_bytes(blob)
                if ad.node != node:
                    raise ProtocolError(f"device {node} sent device {ad.node}'s advertisement")
                ad.verify(self.plan.context, self._identities.get(node), plan_digest=self.plan.digest)
            except SecAggError as error:
                self._refuse(node, error)
                continue
            self._ads[node] = ad
        return {node: {peer: self._ads[peer] for peer in self.plan.neighbours_of(node) if peer in self._ads}
                for node in self._ads}

    def route_shares(self, sealed: Mapping[int, Mapping[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """U2: each dealer's sealed shares, regrouped by holder (the coordinator cannot open them)."""
        inbox: dict[int, dict[int, bytes]] = {}
        for dealer, by_holder in sealed.items():
            if dealer not in self._ads:
                self._refuse(dealer, ProtocolError(f"device {dealer} dealt shares without an accepted advertisement"))
                continue
            wrong = [h for h in by_holder if h not in self._ads or h not in self.plan.neighbours_of(dealer)]
            if wrong:
                self._refuse(dealer, ProtocolError(f"device {dealer} dealt shares to non-neighbours {wrong}"))
                continue
            for holder, blob in by_holder.items():
                inbox.setdefault(holder, {})[dealer] = blob
        self._routed = {holder: set(dealers) for holder, dealers in inbox.items()}
        self._dealers = {dealer for dealers in self._routed.values() for dealer in dealers}
        return inbox

    def receive_masked(self, uploads: Mapping[int, bytes]) -> list[int]:
        """U3: the devices whose masked upload is well formed (sorted). Ask them to unmask."""
        for node, blob in uploads.items():
            if node not in self._routed or node not in self._dealers:
                self._refuse(node, ProtocolError(f"device {node} uploaded without having dealt and received shares"))
                continue
            try:
                self._masked[node] = decode_masked(blob, node, self.plan.length, self.plan.bits)
            except SecAggError as error:
                self._refuse(node, error)
        survivors = sorted(self._masked)
        self.plan.check_capacity(len(survivors))
        if len(survivors) < self.plan.reconstruction_threshold:
            raise UnmaskError(f"{len(survivors)} masked uploads arrived, fewer than the threshold "
                              f"{self.plan.reconstruction_threshold}: the round cannot be unmasked")
        return survivors

    def receive_consistency(self, signatures: Mapping[int, bytes]) -> dict[int, bytes]:
        """Under the consistency check: the survivors' valid signatures over the survivor set (a bad
        one drops its device). Fewer than the quorum and no device would unmask: the round aborts."""
        survivors = sorted(self._masked)
        for node, signature in signatures.items():
            if node not in self._masked:
                continue
            try:
                check_signature(self.plan, survivors, node, signature, self._identities.get(node))
            except SecAggError as error:
                self._refuse(node, error)
                continue
            self.signatures[node] = bytes(signature)
        if len(self.signatures) < self.plan.consistency_quorum:
            raise ConsistencyError(f"{len(self.signatures)} devices signed the survivor set, fewer than the "
                                   f"quorum {self.plan.consistency_quorum}: no device will unmask")
        return dict(self.signatures)

    def unmask(self, reveals: Mapping[int, bytes]) -> tuple[np.ndarray, int]:
        """(the exact sum of the survivors' levels mod 2^r, the number of survivors)."""
        survivors = set(self._masked)
        seed_shares: dict[int, list[tuple[int, bytes]]] = {}
        key_shares: dict[int, list[tuple[int, bytes]]] = {}
        for holder, blob in reveals.items():
            if holder not in survivors:
                continue  # only devices whose upload counts may speak for their neighbours
            try:
                records = decode_reveals(blob, holder)
            except SecAggError as error:
                self._refuse(holder, error)
                continue
            dealt = self._routed.get(holder, set())
            records = [r for r in records if r.dealer in dealt]  # a share it was never dealt: ignored
            wrong = [r.dealer for r in records if r.kind != (SEED if r.dealer in survivors else KEY)]
            if wrong:  # never both kinds of one device's secrets: this device's reveals are all set aside
                self._refuse(holder, UnmaskError(f"device {holder} revealed the wrong kind of share of devices {wrong}"))
                continue
            for record in records:
                bucket = seed_shares if record.kind == SEED else key_shares
                bucket.setdefault(record.dealer, []).append((self.plan.holder_index(record.dealer, holder),
                                                             record.share))
        bits, count = self.plan.bits, self.plan.length
        total = np.zeros(count, dtype=np.uint32)
        for node in sorted(survivors):
            total += self._masked[node]
        for node in sorted(survivors):
            seed = self._rebuild(node, seed_shares.get(node, []), self._seed_checks(node))
            total -= mask(seed, count, bits)
        for dropped in sorted(self._dealers - survivors):
            key = self._rebuild(dropped, key_shares.get(dropped, []), self._key_checks(dropped))
            private = x25519_from_private_bytes(key)
            for peer in self.plan.neighbours_of(dropped):
                if peer in survivors and dropped in self._routed.get(peer, ()):
                    pair = mask(pair_mask_seed(self.plan, private, self._ads[peer].s_public, dropped, peer), count, bits)
                    if peer < dropped:  # the survivor added this mask
                        total -= pair
                    else:
                        total += pair
        total &= ring_mask(bits)
        return total, len(survivors)

    def _seed_checks(self, node: int):
        expected = self._ads[node].commitment
        return lambda seed: seed_commitment(self.plan.context, node, seed) == expected

    def _key_checks(self, node: int):
        expected = self._ads[node].s_public

        def check(key: bytes) -> bool:
            try:
                return public_bytes(x25519_from_private_bytes(key).public_key()) == expected
            except ValueError:
                return False
        return check

    def _rebuild(self, node: int, shares: list[tuple[int, bytes]], check) -> bytes:
        threshold = self.plan.reconstruction_threshold
        if len(shares) < threshold:
            raise UnmaskError(f"{len(shares)} shares of device {node} arrived, the threshold is {threshold}: "
                              "the sum cannot be unmasked")
        for subset in itertools.islice(itertools.combinations(shares, threshold), _MAX_SUBSETS):
            try:
                secret = combine_secret(list(subset), threshold)
            except ShareError:
                continue
            if check(secret):
                return secret
        raise ShareError(f"no subset of the {len(shares)} shares of device {node} rebuilds the secret it "
                         "committed to: shares were altered")
