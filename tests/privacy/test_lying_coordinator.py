"""Secure aggregation against a coordinator that may lie (Privacy II): the plan is bound across
stages (L4), the consistency round stops a coordinator from showing devices different survivor
sets, and the device-side checks that SECURITY.md claims run on the path a real device takes
(its state saved and restored between messages)."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedge.privacy.consistency import sign_survivors
from fedge.privacy.errors import AdvertisementError, ConsistencyError, ProtocolError, ShareError
from fedge.privacy.messages import KEY, SEED, decode_reveals
from fedge.privacy.plan import SecAggPlan
from fedge.privacy.secagg_device import SecAggDevice, export_state, restore_state
from fedge.privacy.secagg_server import SecAggServer

from tests.privacy.secagg_round import deal_shares, identities, make_plan, run_round


def _levels(plan: SecAggPlan, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {node: rng.integers(0, plan.grid.top + 1, plan.length).astype(np.uint32) for node in plan.participants}


def _saved(device: SecAggDevice, plan: SecAggPlan, key: Ed25519PrivateKey) -> SecAggDevice:
    """The device as a real one is between two messages: exported to ``context.state``, restored."""
    return restore_state(plan, device.node, key, export_state(device))


def _masked(plan: SecAggPlan, keys=None):  # type: ignore[no-untyped-def]
    """Stages 1-3 for everyone, each device saved and restored between stages as on a real device."""
    keys = keys or identities(plan)
    devices, server, inbox = deal_shares(plan, keys)
    devices = {n: _saved(d, plan, keys[n]) for n, d in devices.items()}
    levels = _levels(plan)
    uploads = {n: devices[n].masked_input(inbox[n], levels[n]) for n in devices}
    devices = {n: _saved(d, plan, keys[n]) for n, d in devices.items()}
    return devices, server, uploads, levels, keys


# -- L4: one plan for every stage -----------------------------------------------------------------

def test_a_device_refuses_a_later_stage_under_another_plan() -> None:
    """Privacy II, L4. The device checked only the run and round between stages, so a coordinator
    could advertise under one plan and collect shares under another (a lower threshold, other
    participants). The plan's digest is now kept with the device's state and signed into its
    advertisement: either change is refused."""
    plan = make_plan(6, 16, threshold=4)
    keys = identities(plan)
    device = SecAggDevice(plan, plan.participants[0], keys[plan.participants[0]])
    ad = device.advertise()
    lowered = make_plan(6, 16, threshold=0)  # same run, same round, another threshold
    assert lowered.reconstruction_threshold != plan.reconstruction_threshold
    with pytest.raises(ProtocolError, match="plan changed"):
        restore_state(lowered, device.node, keys[device.node], export_state(device))
    with pytest.raises(AdvertisementError, match="invalid signature"):
        ad.verify(lowered.context, keys[device.node].public_key(), plan_digest=lowered.digest)
    # the coordinator refuses it too: an advertisement for one plan does not count under another
    server = SecAggServer(lowered, {n: k.public_key() for n, k in keys.items()})
    assert server.receive_advertisements({ad.node: ad.to_bytes()}) == {}
    assert "invalid signature" in server.refused[ad.node]


def test_every_public_parameter_changes_the_digest() -> None:
    base = make_plan(6, 16)
    others = [make_plan(7, 16), make_plan(6, 17), make_plan(6, 16, bits=5), make_plan(6, 16, clip=0.5),
              make_plan(6, 16, weight_cap=2), make_plan(6, 16, round_=2), make_plan(6, 16, neighbours=4),
              make_plan(6, 16, threshold=4), make_plan(6, 16, consistency=True)]
    digests = {p.digest for p in others}
    assert base.digest not in digests and len(digests) == len(others)
    assert make_plan(6, 16).digest == base.digest


# -- the consistency round ------------------------------------------------------------------------

def test_with_the_consistency_round_the_sum_is_still_exact_under_dropouts() -> None:
    plan = make_plan(9, 64, consistency=True)
    levels = _levels(plan, 2)
    total, survivors, server = run_round(plan, levels, drop_after_sharing={plan.participants[3]},
                                         drop_before_unmask={plan.participants[5]})
    assert plan.participants[3] not in survivors
    expected = np.sum([levels[n].astype(np.int64) for n in survivors], axis=0)
    assert np.array_equal(total.astype(np.int64), expected)


def _split(plan: SecAggPlan, shown: dict[int, list[int]], devices, keys, *, forward_all: bool):  # type: ignore[no-untyped-def]
    """A lying coordinator: device n is shown the survivor set ``shown[n]``; every device signs what
    it was shown; the coordinator then hands each device either every signature (``forward_all``)
    or only those over the set that device was shown. Returns (reveals, refusals) per device."""
    signatures = {n: devices[n].consistency(shown[n]) for n in shown}
    public = {n: keys[n].public_key() for n in plan.participants}
    reveals, refusals = {}, {}
    for n in shown:
        given = signatures if forward_all else {m: s for m, s in signatures.items() if shown[m] == shown[n]}
        try:
            reveals[n] = devices[n].unmask(shown[n], given, public)
        except ConsistencyError as error:
            refusals[n] = str(error)
    return reveals, refusals


@pytest.mark.parametrize("forward_all", [True, False], ids=["all-signatures", "matching-signatures-only"])
def test_a_coordinator_showing_two_halves_different_survivor_sets_learns_nothing(forward_all) -> None:
    """The issue's acceptance. Six devices; the coordinator tells three of them that device X
    survived (to collect X's seed shares) and the other three that X dropped (to collect its key
    shares). Neither set gathers signatures from a majority of the six, so every honest device
    aborts and nothing is revealed, whichever signatures the coordinator forwards."""
    plan = make_plan(6, 32, consistency=True)
    devices, server, uploads, levels, keys = _masked(plan)
    everyone = sorted(plan.participants)
    x = everyone[0]
    without_x = [n for n in everyone if n != x]
    # x and two others are shown "x survived", the other three "x dropped": 3 signatures each,
    # short of the quorum of 4
    shown = {n: (everyone if i < 3 else without_x) for i, n in enumerate(everyone)}
    reveals, refusals = _split(plan, shown, devices, keys, forward_all=forward_all)
    assert reveals == {}
    assert set(refusals) == set(everyone)
    assert all(any(why in r for why in ("did not sign this survivor set", "quorum", "outside it"))
               for r in refusals.values())


def test_a_minority_shown_another_set_aborts_and_the_majority_reveals_one_consistent_kind() -> None:
    """One device is told that device X dropped while the five others are told it survived: the one
    aborts (its set has a single signature), the five reveal, and across everything revealed each
    device's secrets come out as one kind only, so X's update stays hidden in the sum."""
    plan = make_plan(6, 32, consistency=True)
    devices, server, uploads, levels, keys = _masked(plan)
    everyone = sorted(plan.participants)
    x, lied_to = everyone[0], everyone[1]
    shown = {n: everyone for n in everyone}
    shown[lied_to] = [n for n in everyone if n != x]
    reveals, refusals = _split(plan, shown, devices, keys, forward_all=False)
    assert set(refusals) == {lied_to} and set(reveals) == set(everyone) - {lied_to}
    kinds: dict[int, set[int]] = {}
    for holder, blob in reveals.items():
        for record in decode_reveals(blob, holder):
            kinds.setdefault(record.dealer, set()).add(record.kind)
    assert kinds and all(k == {SEED} for k in kinds.values())


def test_a_forwarded_signature_that_does_not_verify_aborts_the_device() -> None:
    plan = make_plan(5, 16, consistency=True)
    devices, server, uploads, levels, keys = _masked(plan)
    survivors = server.receive_masked(uploads)
    signatures = {n: devices[n].consistency(survivors) for n in survivors}
    public = {n: keys[n].public_key() for n in plan.participants}
    bad = dict(signatures)
    victim = survivors[0]
    bad[survivors[1]] = sign_survivors(Ed25519PrivateKey.generate(), plan, survivors)  # not its key
    with pytest.raises(ConsistencyError, match="did not sign"):
        devices[victim].unmask(survivors, bad, public)
    with pytest.raises(ProtocolError, match="called at stage done"):  # and it never gets a second try
        devices[victim].unmask(survivors, signatures, public)


def test_one_signature_cannot_count_twice_and_the_set_must_be_the_one_signed() -> None:
    plan = make_plan(5, 16, consistency=True)
    devices, server, uploads, levels, keys = _masked(plan)
    survivors = server.receive_masked(uploads)
    signatures = {n: devices[n].consistency(survivors) for n in survivors}
    public = {n: keys[n].public_key() for n in plan.participants}
    a, b, c = survivors[:3]
    # the coordinator claims a's key and signature are also b's
    doubled = dict(signatures)
    doubled[b] = signatures[a]
    with pytest.raises(ConsistencyError, match="same identity key|identity changed"):
        devices[c].unmask(survivors, doubled, {**public, b: public[a]})
    # and asking a device to unmask for another set than the one it signed
    with pytest.raises(ConsistencyError, match="signed another survivor set"):
        devices[a].unmask([n for n in survivors if n != survivors[-1]], signatures, public)


def test_without_a_quorum_the_coordinator_aborts_before_asking_anyone() -> None:
    plan = make_plan(6, 16, consistency=True)
    devices, server, uploads, levels, keys = _masked(plan)
    survivors = server.receive_masked(uploads)
    signed = {n: devices[n].consistency(survivors) for n in survivors[:4]}  # a majority is not enough
    with pytest.raises(ConsistencyError, match="quorum 5"):
        server.receive_consistency(signed)


def test_two_colluders_of_six_no_longer_unmask_a_device_by_equivocation() -> None:
    """Privacy audit 2, N3, at the default parameters. Six devices, degree 5; x and a are shown
    "x survived" (to collect x's seed shares), b1 and b2 "x dropped" (to collect its key shares),
    and the colluders c1, c2 sign both sets and hand over both kinds of their shares of x. With
    strict majorities (t = 3, quorum 4) both sets gathered four signatures and x's update came out
    exactly. Now the quorum is five of six and t four of five: every honest device refuses to
    reveal, and what the colluders hold (two shares of each kind) is short of t."""
    from fedge.privacy.neighbourhood import max_colluders

    plan = make_plan(6, 32, consistency=True)
    assert (plan.consistency_quorum, plan.reconstruction_threshold, plan.degree) == (5, 4, 5)
    assert max_colluders(plan.degree, plan.reconstruction_threshold) == 2
    devices, server, uploads, levels, keys = _masked(plan)
    x, a, b1, b2, c1, c2 = sorted(plan.participants)
    with_x, without_x = sorted(plan.participants), [n for n in sorted(plan.participants) if n != x]
    # each colluder signs both sets (two copies of its saved state, one per set)
    signatures: dict[str, dict[int, bytes]] = {"with": {}, "without": {}}
    for n in (x, a):
        signatures["with"][n] = devices[n].consistency(with_x)
    for n in (b1, b2):
        signatures["without"][n] = devices[n].consistency(without_x)
    for c in (c1, c2):
        signatures["with"][c] = _saved(devices[c], plan, keys[c]).consistency(with_x)
        signatures["without"][c] = _saved(devices[c], plan, keys[c]).consistency(without_x)
    assert len(signatures["with"]) == len(signatures["without"]) == 4  # the old quorum, reached twice
    public = {n: keys[n].public_key() for n in plan.participants}
    for n, shown, kind in ((x, with_x, "with"), (a, with_x, "with"), (b1, without_x, "without"),
                           (b2, without_x, "without")):
        with pytest.raises(ConsistencyError, match="quorum"):
            devices[n].unmask(shown, signatures[kind], public)
    for kind in ("with", "without"):  # nor does the coordinator ask anyone
        with pytest.raises(ConsistencyError, match="quorum 5"):
            SecAggServer(plan, public).receive_consistency(signatures[kind])


# -- SECURITY.md's claims, on the saved-and-restored path ------------------------------------------

def test_a_device_never_reveals_both_even_across_a_save_and_restore() -> None:
    """"Never reveals both", on the path a real device takes: its state is exported to
    ``context.state`` after each message and restored for the next, and the stage travels with it,
    so a second unmask request (with another survivor set, to get the other kind of share) meets a
    device that has already revealed."""
    plan = make_plan(5, 8)
    devices, server, uploads, levels, keys = _masked(plan)
    survivors = server.receive_masked(uploads)
    node = survivors[0]
    devices[node].unmask(survivors)
    restored = restore_state(plan, node, keys[node], export_state(devices[node]))
    with pytest.raises(ProtocolError, match="called at stage done"):
        restored.unmask([n for n in survivors if n != survivors[1]])


def test_an_altered_key_share_under_dropouts_is_caught_and_the_sum_stays_exact() -> None:
    """With a device dropping after sharing, its key is rebuilt from its neighbours' key shares; one
    altered key share fails the public-key check and another subset rebuilds it."""
    plan = make_plan(8, 64)
    keys = identities(plan)
    devices, server, inbox = deal_shares(plan, keys)
    levels = _levels(plan, 4)
    dropped = plan.participants[2]
    uploads = {n: devices[n].masked_input(inbox[n], levels[n]) for n in devices if n != dropped}
    survivors = server.receive_masked(uploads)
    reveals = {n: devices[n].unmask(survivors) for n in survivors}
    liar = next(n for n in survivors if dropped in plan.neighbours_of(n))
    records = decode_reveals(reveals[liar], liar)
    assert any(r.dealer == dropped and r.kind == KEY for r in records)
    blob = bytearray(reveals[liar])
    from fedge.privacy.messages import _REVEAL  # the record layout: header, then the share
    from fedge.privacy.shamir import SHARE_BYTES
    at = [i for i, r in enumerate(records) if r.dealer == dropped][0] * (_REVEAL.size + SHARE_BYTES) + _REVEAL.size
    blob[at + 5] ^= 0x40
    reveals[liar] = bytes(blob)
    total, _ = server.unmask(reveals)
    expected = np.sum([levels[n].astype(np.int64) for n in survivors], axis=0)
    assert np.array_equal(total.astype(np.int64), expected)


def test_a_share_delivered_to_the_wrong_device_is_refused() -> None:
    """The coordinator routes dealer D's sealed shares for holder A to holder B (both D's
    neighbours): B cannot open them, and says who they were from."""
    plan = make_plan(6, 16)
    devices, server, inbox = deal_shares(plan)
    a, b = plan.participants[0], plan.participants[1]
    dealer = next(d for d in inbox[a] if d in inbox[b] and d not in (a, b))
    misrouted = dict(inbox[b])
    misrouted[dealer] = inbox[a][dealer]
    with pytest.raises(ShareError, match=f"from device {dealer} to device {b}"):
        devices[b].masked_input(misrouted, np.zeros(plan.length, np.uint32))
