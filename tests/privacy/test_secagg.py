"""Secure aggregation, stage by stage: exact sums under dropouts, uniform uploads, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scipy import stats

from fedge.privacy.errors import AdvertisementError, MaskedInputError, RingError, ShareError, UnmaskError
from fedge.privacy.keys import KeyAdvertisement
from fedge.privacy.messages import decode_masked
from fedge.privacy.plan import SecAggPlan
from fedge.privacy.secagg_device import SecAggDevice
from fedge.privacy.secagg_server import SecAggServer

from tests.privacy.secagg_round import deal_shares, identities, make_plan, run_round


def _levels(plan: SecAggPlan, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {node: rng.integers(0, plan.grid.top + 1, plan.length).astype(np.uint32) for node in plan.participants}


def _reveals(plan: SecAggPlan, levels: dict[int, np.ndarray]):  # type: ignore[no-untyped-def]
    """Every stage up to the reveals, nobody dropping: (server, survivors, each survivor's reveals)."""
    devices, server, inbox = deal_shares(plan)
    survivors = server.receive_masked({n: devices[n].masked_input(inbox[n], levels[n]) for n in devices})
    return server, survivors, {n: devices[n].unmask(survivors) for n in survivors}


def _plain_sum(levels: dict[int, np.ndarray], nodes) -> np.ndarray:
    return np.sum([levels[n].astype(np.int64) for n in nodes], axis=0)


def test_ten_devices_two_dropping_after_masking_setup_sum_exactly() -> None:
    """The issue's acceptance: 10 devices, 2 drop after dealing their shares (their pairwise masks are
    in the survivors' uploads); the unmasked sum equals the plain sum of the 8 survivors' levels."""
    plan = make_plan(10, 1000)
    levels = _levels(plan)
    dropped = {plan.participants[2], plan.participants[7]}
    total, survivors, server = run_round(plan, levels, drop_after_sharing=dropped)
    assert set(survivors) == set(plan.participants) - dropped
    assert np.array_equal(total.astype(np.int64), _plain_sum(levels, survivors))
    assert server.refused == {}


def test_sparse_neighbourhoods_dropouts_at_every_stage() -> None:
    """40 devices on a 12-regular graph (SecAgg+), dropouts before sharing, after sharing and before
    unmasking: still the exact sum of those whose uploads arrived."""
    plan = make_plan(40, 300, neighbours=12)
    assert plan.degree == 12 and plan.reconstruction_threshold == 7
    assert all(len(peers) >= 12 for peers in plan.graph.values())
    levels = _levels(plan, 1)
    p = plan.participants
    total, survivors, _ = run_round(plan, levels, drop_before_sharing={p[0]}, drop_after_sharing={p[5], p[9]},
                                    drop_before_unmask={p[20], p[30]})
    assert set(survivors) == set(p) - {p[0], p[5], p[9]}
    assert np.array_equal(total.astype(np.int64), _plain_sum(levels, survivors))


def test_a_masked_upload_is_uniform_in_the_ring() -> None:
    """All-zero levels (the most structured input) still upload as uniform ring elements: a chi-square
    test over 64 buckets does not reject uniformity. The keys are fresh per run, so the threshold is a
    false-alarm rate: 1e-7 (1e-4 failed once in CI at p = 1.7e-5; 150 repeats gave uniform p-values),
    while any real defect (a mask not reduced to the ring, a zero mask) gives p far below 1e-100 here."""
    plan = make_plan(5, 50_000)
    zeros = {node: np.zeros(plan.length, np.uint32) for node in plan.participants}
    devices, server, inbox = deal_shares(plan)
    node = plan.participants[0]
    upload = decode_masked(devices[node].masked_input(inbox[node], zeros[node]), node, plan.length, plan.bits)
    counts = np.bincount((upload.astype(np.uint64) * 64 >> plan.bits).astype(np.int64), minlength=64)
    assert stats.chisquare(counts).pvalue > 1e-7
    assert upload.max() < (1 << plan.bits)


def test_the_ring_cannot_wrap() -> None:
    """Every device at the top level: the sum n (2^b - 1) is still exact, because the ring was sized
    for n before the round; and a ring too small for its summands is refused up front."""
    for devices, bits in ((10, 4), (33, 4), (17, 8)):
        plan = make_plan(devices, 64, bits=bits)
        assert plan.bits == bits + int(np.ceil(np.log2(devices)))
        top = {n: np.full(plan.length, plan.grid.top, np.uint32) for n in plan.participants}
        total, survivors, _ = run_round(plan, top)
        assert np.all(total == len(survivors) * plan.grid.top)
    with pytest.raises(RingError, match="ring"):
        make_plan(4, 8, bits=16).check_capacity(5)
    with pytest.raises(RingError, match="33-bit ring"):
        make_plan(1 << 17, 8, bits=16)  # 16 + 17 bits: refused before any device does any work


def test_an_altered_share_is_refused_by_its_holder() -> None:
    plan = make_plan(6, 32)
    devices, server, inbox = deal_shares(plan)
    holder = plan.participants[0]
    dealer = next(iter(inbox[holder]))
    blob = bytearray(inbox[holder][dealer])
    blob[20] ^= 1
    inbox[holder][dealer] = bytes(blob)
    with pytest.raises(ShareError, match=f"from device {dealer} to device {holder} failed authentication"):
        devices[holder].masked_input(inbox[holder], np.zeros(plan.length, np.uint32))


def test_a_revealed_share_that_was_altered_cannot_corrupt_the_sum() -> None:
    """A survivor reveals a wrong seed share: the coordinator's commitment check catches it and rebuilds
    from another subset of shares (more than the threshold arrived), so the sum is still exact."""
    plan = make_plan(8, 64)
    levels = _levels(plan, 3)
    server, survivors, reveals = _reveals(plan, levels)
    liar = survivors[0]
    altered = bytearray(reveals[liar])
    altered[-1] ^= 0xFF  # the last byte of its last share
    reveals[liar] = bytes(altered)
    total, _ = server.unmask(reveals)
    assert np.array_equal(total.astype(np.int64), _plain_sum(levels, survivors))


def test_unsigned_or_foreign_advertisements_are_refused() -> None:
    plan = make_plan(4, 16)
    keys = identities(plan)
    device = SecAggDevice(plan, plan.participants[0], keys[plan.participants[0]])
    ad = device.advertise()
    unsigned = KeyAdvertisement(ad.node, ad.c_public, ad.s_public, ad.commitment, b"")
    with pytest.raises(AdvertisementError, match="unsigned|bytes"):
        KeyAdvertisement.from_bytes(unsigned.to_bytes())
    with pytest.raises(AdvertisementError, match="unsigned"):
        unsigned.verify(plan.context, keys[ad.node].public_key(), plan_digest=plan.digest)
    with pytest.raises(AdvertisementError, match="invalid signature"):
        ad.verify(plan.context, Ed25519PrivateKey.generate().public_key(), plan_digest=plan.digest)  # someone else's identity
    other_round = make_plan(4, 16, round_=2)
    with pytest.raises(AdvertisementError, match="invalid signature"):
        ad.verify(other_round.context, keys[ad.node].public_key(), plan_digest=other_round.digest)  # replayed into another round
    with pytest.raises(AdvertisementError, match="no registered identity"):
        ad.verify(plan.context, None, plan_digest=plan.digest)
    # the coordinator drops the device and the round goes on without it
    server = SecAggServer(plan, {n: k.public_key() for n, k in keys.items()})
    forged = KeyAdvertisement.create(plan.context, ad.node, Ed25519PrivateKey.generate(), ad.c_public,
                                     ad.s_public, ad.commitment, plan_digest=plan.digest)
    routed = server.receive_advertisements({ad.node: forged.to_bytes()})
    assert routed == {} and "invalid signature" in server.refused[ad.node]
    # and a device refuses a neighbour's forged advertisement that a coordinator passes on
    neighbour = SecAggDevice(plan, plan.participants[1], keys[plan.participants[1]])
    neighbour.advertise()
    with pytest.raises(AdvertisementError, match="invalid signature"):
        neighbour.share_keys({ad.node: forged}, {n: k.public_key() for n, k in keys.items()})


def test_a_device_never_reveals_both_shares_and_stages_run_in_order() -> None:
    plan = make_plan(5, 8)
    keys = identities(plan)
    device = SecAggDevice(plan, plan.participants[0], keys[plan.participants[0]])
    with pytest.raises(Exception, match="called at stage advertise"):
        device.masked_input({}, np.zeros(plan.length, np.uint32))
    levels = _levels(plan)
    total, survivors, server = run_round(plan, levels, keys=keys)
    assert np.array_equal(total.astype(np.int64), _plain_sum(levels, survivors))
    # one reveal per round: a second request (say, with another survivor set) is refused
    devices, _, inbox = deal_shares(plan, keys)
    for n, d in devices.items():
        d.masked_input(inbox[n], levels[n])
    done = devices[plan.participants[1]]
    done.unmask(list(plan.participants))
    with pytest.raises(Exception, match="called at stage done"):
        done.unmask([n for n in plan.participants if n != plan.participants[0]])


def test_too_few_survivors_cannot_be_unmasked() -> None:
    plan = make_plan(5, 8)
    with pytest.raises(UnmaskError, match="threshold"):
        run_round(plan, _levels(plan), drop_after_sharing=set(plan.participants[:3]))


def test_a_malformed_upload_drops_its_device_only() -> None:
    plan = make_plan(6, 40)
    with pytest.raises(MaskedInputError, match="the round expects"):
        decode_masked(b"FSM1" + bytes(20), 1, plan.length, plan.bits)
    devices, server, inbox = deal_shares(plan)
    levels = _levels(plan, 5)
    uploads = {n: devices[n].masked_input(inbox[n], levels[n]) for n in devices}
    bad = plan.participants[1]
    uploads[bad] = uploads[bad][:-3]
    survivors = server.receive_masked(uploads)
    assert bad not in survivors and "payload bytes" in server.refused[bad]
    total, _ = server.unmask({n: devices[n].unmask(survivors) for n in survivors})
    assert np.array_equal(total.astype(np.int64), _plain_sum(levels, survivors))


def test_a_reveal_of_the_wrong_kind_is_set_aside_and_the_round_goes_on() -> None:
    """A survivor asks the coordinator to take a key share of a device that survived (both kinds of
    its secrets would then be out): its reveals are refused, the others still rebuild the exact sum."""
    from fedge.privacy.messages import KEY, Reveal, decode_reveals, encode_reveals

    plan = make_plan(8, 64)
    levels = _levels(plan, 7)
    server, survivors, reveals = _reveals(plan, levels)
    liar = survivors[0]
    reveals[liar] = encode_reveals([Reveal(r.dealer, KEY, r.share) for r in decode_reveals(reveals[liar], liar)])
    total, _ = server.unmask(reveals)
    assert "wrong kind" in server.refused[liar]
    assert np.array_equal(total.astype(np.int64), _plain_sum(levels, survivors))


def test_a_device_refuses_to_unmask_when_too_few_of_its_own_neighbours_survived() -> None:
    """Privacy II, L5. The device's check counted every survivor of the round against its
    neighbourhood's threshold; on a sparse graph enough devices can survive overall while fewer
    than t of this device's neighbours do. It counts its own neighbours now (|N(u) ∩ U3| ≥ t)."""
    plan = make_plan(20, 8, neighbours=4)  # H(4, 20): each device has 4 neighbours, t = 3
    devices, server, inbox = deal_shares(plan)
    node = plan.participants[0]
    mine = set(plan.neighbours_of(node))
    survivors = [n for n in plan.participants if n not in mine or n == node]  # 16 survive, none of its neighbours
    survivors += sorted(mine)[:2]  # two of its four neighbours: fewer than t = 3
    assert len(survivors) >= plan.reconstruction_threshold
    device = devices[node]
    device.masked_input(inbox[node], _levels(plan)[node])
    with pytest.raises(UnmaskError, match="neighbours survived"):
        device.unmask(sorted(set(survivors)))
