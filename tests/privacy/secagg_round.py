"""An in-process secure-aggregation round for the unit tests: every stage, with chosen dropouts."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.privacy.keys import RoundContext
from fedge.privacy.plan import SecAggPlan
from fedge.privacy.secagg_device import SecAggDevice
from fedge.privacy.secagg_server import SecAggServer
from fedge.privacy.shared_grid import SharedGrid


def make_plan(devices: int, dimension: int, *, bits: int = 4, neighbours: int = 0, weight_cap: int = 1,
              clip: float = 1.0, round_: int = 1, threshold: int = 0, consistency: bool = False) -> SecAggPlan:
    return SecAggPlan(RoundContext(b"test-run", round_), tuple(range(100, 100 + devices)),
                      SharedGrid(bits, clip, weight_cap), dimension, graph_seed=7, neighbours=neighbours,
                      threshold=threshold, consistency=consistency)


def identities(plan: SecAggPlan) -> dict[int, Ed25519PrivateKey]:
    return {node: Ed25519PrivateKey.generate() for node in plan.participants}


def deal_shares(plan: SecAggPlan, keys: dict[int, Ed25519PrivateKey] | None = None):
    """Stages 1 and 2 for every participant: (devices, server, each device's inbox of sealed shares)."""
    keys = keys or identities(plan)
    devices = {n: SecAggDevice(plan, n, keys[n]) for n in plan.participants}
    server = SecAggServer(plan, {n: k.public_key() for n, k in keys.items()})
    ads = server.receive_advertisements({n: d.advertise().to_bytes() for n, d in devices.items()})
    inbox = server.route_shares({n: devices[n].share_keys(ads[n], server._identities) for n in devices})
    return devices, server, inbox


def run_round(plan: SecAggPlan, levels: dict[int, np.ndarray], *, drop_after_sharing: Collection[int] = (),
              drop_before_sharing: Collection[int] = (), drop_before_unmask: Collection[int] = (),
              keys: dict[int, Ed25519PrivateKey] | None = None):
    """Run every stage; returns (level sum, survivors, server)."""
    keys = keys or identities(plan)
    devices = {node: SecAggDevice(plan, node, keys[node]) for node in plan.participants}
    server = SecAggServer(plan, {node: key.public_key() for node, key in keys.items()})
    ads = {node: device.advertise().to_bytes() for node, device in devices.items()}
    routed_ads = server.receive_advertisements(ads)
    sealed = {node: devices[node].share_keys(routed_ads[node], server._identities)
              for node in routed_ads if node not in drop_before_sharing}
    inbox = server.route_shares(sealed)
    uploads = {node: devices[node].masked_input(inbox.get(node, {}), levels[node])
               for node in sealed if node not in drop_after_sharing}
    survivors = server.receive_masked(uploads)
    if plan.consistency:
        signatures = server.receive_consistency({node: devices[node].consistency(survivors) for node in survivors})
        reveals = {node: devices[node].unmask(survivors, signatures, server._identities)
                   for node in signatures if node not in drop_before_unmask}
    else:
        reveals = {node: devices[node].unmask(survivors) for node in survivors if node not in drop_before_unmask}
    total, count = server.unmask(reveals)
    return total, survivors, server
