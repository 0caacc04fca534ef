"""The versioned lattice downlink: exact composition of versions, catch-up, snapshots, bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedge.aggregation.broadcast import DownlinkSpec, VersionedBroadcast, lattice_model, model_digest, parse_downlink
from fedge.compression.lattice import decode_lattice

SIZES = [600, 300, 100]


def _model(seed: int = 0) -> torch.Tensor:
    return torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(seed)) * 0.1


class Device:
    """A device's copy, kept the way ``edge_client.downlink`` keeps it: integer n + version."""

    def __init__(self, server: VersionedBroadcast) -> None:
        self.server, self.n, self.version = server, None, None

    def receive(self) -> str:
        message = self.server.message_for(id(self))
        decoded = decode_lattice(message.payload, self.server.numel)
        if message.kind == "snapshot":
            self.n = torch.from_numpy(decoded.values.copy())
        else:
            assert decoded.base == self.version
            self.n[torch.from_numpy(decoded.indices)] += torch.from_numpy(decoded.values)
        self.version = decoded.version
        self.server.confirm(id(self), decoded.version)
        return message.kind

    @property
    def copy(self) -> torch.Tensor:
        return lattice_model(self.server.base, self.server.steps, self.n)


def test_every_path_to_a_version_gives_the_coordinators_bits() -> None:
    server = VersionedBroadcast(DownlinkSpec(ratio=0.05, cache=8), _model(), SIZES)
    params = server.base.clone()
    every, weekly, rare = Device(server), Device(server), Device(server)
    kinds: dict[str, set[str]] = {"every": set(), "weekly": set(), "rare": set()}
    gen = torch.Generator().manual_seed(1)
    for version in range(1, 41):
        params = params + 0.01 * torch.randn(params.numel(), generator=gen)
        server.publish(params, version)
        for name, device, period in (("every", every, 1), ("weekly", weekly, 5), ("rare", rare, 13)):
            if version % period == 0 or version == 1:
                kinds[name].add(device.receive())
                assert torch.equal(device.copy, server.public)  # bit-identical, whichever path
                assert model_digest(device.copy) == server.digest
    assert kinds["every"] == {"snapshot", "current"}
    assert kinds["weekly"] == {"snapshot", "catch-up"}  # 5 behind: the sum of five cached changes
    assert kinds["rare"] == {"snapshot"}  # 13 behind > cache of 8: a snapshot


def test_catch_up_is_smaller_than_the_changes_it_sums() -> None:
    server = VersionedBroadcast(DownlinkSpec(ratio=0.02, cache=16), _model(), SIZES)
    params = server.base.clone()
    gen = torch.Generator().manual_seed(2)
    singles = []
    for version in range(1, 11):
        params = params + 0.01 * torch.randn(params.numel(), generator=gen)
        server.publish(params, version)
        singles.append(len(server.catch_up(version - 1)))
    composed = server.catch_up(0)
    assert composed is not None and len(composed) < sum(singles)


def test_server_error_feedback_closes_the_gap_once_the_model_stops() -> None:
    server = VersionedBroadcast(DownlinkSpec(ratio=0.1, bits=8), _model(), SIZES)
    target = server.base + 0.05 * torch.randn(server.numel, generator=torch.Generator().manual_seed(3))
    for version in range(1, 80):
        server.publish(target, version)
    gap = (target - server.public).abs()
    assert float(gap.max()) <= float(server.steps.max()) / 2 + 1e-7  # within half a lattice step


def test_bookkeeping_and_the_base() -> None:
    server = VersionedBroadcast(DownlinkSpec(cache=3), _model(), SIZES)
    assert server.message_for(7).kind == "snapshot" and server.message_for(7).base is None
    server.publish(_model(1), 1)
    server.confirm(7, 1)
    server.publish(_model(2), 2)
    assert server.message_for(7).kind == "current"
    server.forget(7, base=True)  # it could not rebuild the base: a snapshot with the base
    message = server.message_for(7)
    assert message.kind == "snapshot" and torch.equal(message.base, server.base)
    server.confirm(7, 2)
    assert server.message_for(7).base is None
    unseeded = VersionedBroadcast(DownlinkSpec(), _model(), SIZES, seeded=False)
    assert unseeded.message_for(1).base is not None


def test_an_unseeded_base_goes_to_each_device_once() -> None:
    """A run from a model file: devices cannot rebuild the base, so it ships with the first snapshot;
    a device that replied holds it and gets changes from then on (it used to get a snapshot and the
    fp32 base with every message), until it says it lost it."""
    server = VersionedBroadcast(DownlinkSpec(), _model(), SIZES, seeded=False)
    server.publish(_model(1), 1)
    first = server.message_for(7)
    assert first.kind == "snapshot" and first.base is not None
    server.confirm(7, 1)
    server.publish(_model(2), 2)
    later = server.message_for(7)
    assert later.kind == "current" and later.base is None and server.message_for(8).base is not None
    server.forget(7)  # a timeout: its copy is unknown, the base it stored is still there
    assert server.message_for(7).kind == "snapshot" and server.message_for(7).base is None
    server.forget(7, base=True)  # it says it has no base
    assert server.message_for(7).base is not None


def test_state_round_trip_keeps_versions_and_refuses_a_mismatch() -> None:
    server = VersionedBroadcast(DownlinkSpec(), _model(), SIZES)
    server.publish(_model(5), 1)
    again = VersionedBroadcast(DownlinkSpec(), _model(), SIZES)
    again.load_state_dict(server.state_dict())
    assert again.version == 1 and torch.equal(again.public, server.public) and again.digest == server.digest
    assert again.message_for(1).kind == "snapshot"  # who held what is not kept across a restart
    with pytest.raises(ValueError, match="differs"):
        VersionedBroadcast(DownlinkSpec(ratio=0.5), _model(), SIZES).load_state_dict(server.state_dict())
    bad = server.state_dict() | {"n": torch.zeros(3, dtype=torch.int64)}
    with pytest.raises(ValueError, match="lattice"):
        again.load_state_dict(bad)


def test_spec_parsing() -> None:
    assert parse_downlink("none") is None
    assert parse_downlink("lattice:ratio=0.01,cache=32") == DownlinkSpec(ratio=0.01, cache=32)
    for spec, reason in (("qsgd:bits=8", "compose exactly"), ("lattice:ratio=0", "ratio"),
                         ("lattice:bits=1", "bits"), ("lattice:cache=0", "cache"), ("lattice:speed=2", "no parameter .speed.")):
        with pytest.raises(ValueError, match=reason):
            parse_downlink(spec)
    assert np.isfinite(parse_downlink("lattice").resolution)


def test_a_dense_warm_up_lets_the_first_versions_change_more_coordinates() -> None:
    spec = parse_downlink("lattice:ratio=0.02,warmup=2,dense=0.2")
    assert spec is not None and parse_downlink(spec.spec) == spec and "dense=0.2" in spec.spec
    assert [spec.ratio_at(v) for v in (1, 2, 3, 10)] == [0.2, 0.2, 0.02, 0.02]
    start = _model()
    server = VersionedBroadcast(spec, start, SIZES)
    moved = []
    for version in (1, 2, 3):  # a target far from the copy everywhere: each version changes its full share
        server.publish(start + 10.0 * version, version)
        moved.append(server.changes[version][0].size)
    n = start.numel()
    assert moved[0] == moved[1] == int(np.ceil(0.2 * n)) and moved[2] == int(np.ceil(0.02 * n))
    assert parse_downlink("lattice:ratio=0.05").spec == "lattice:ratio=0.05,bits=16,cache=64,resolution=256"
    for bad in ("lattice:warmup=3", "lattice:dense=0.2", "lattice:warmup=-1,dense=0.2", "lattice:warmup=2,dense=1.5"):
        with pytest.raises(ValueError, match="warmup=N and dense=D"):
            parse_downlink(bad)


def test_lag_measures_how_much_of_the_models_move_the_copy_lacks() -> None:
    """A copy that can follow the model reports a small lag; a 1%, 4-bit copy of a model that moves
    by several initial RMS (as a CNN does over 50 rounds of 10 epochs) stays near the start: its lag
    stays near 1 and the bits limit clamps the coordinates it picks."""
    moves = [torch.full((sum(SIZES),), 0.0)]
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        moves.append(moves[-1] + 0.05 * torch.randn(sum(SIZES), generator=gen))
    follows = VersionedBroadcast(DownlinkSpec(ratio=0.5, bits=16), _model(), SIZES)
    stuck = VersionedBroadcast(DownlinkSpec(ratio=0.01, bits=4), _model(), SIZES)
    for version, move in enumerate(moves[1:], start=1):
        for server in (follows, stuck):
            server.publish(server.base + move, version)
    assert follows.lag < 0.3 and follows.clamped == 0
    assert stuck.lag > 0.95 and stuck.clamped > 0
    assert VersionedBroadcast(DownlinkSpec(), _model(), SIZES).lag == 0.0  # nothing published yet
