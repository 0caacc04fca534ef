"""Secure aggregation in the round engine (in-process grid: fast; the real-process run is in
tests/integration/test_secure_aggregation.py): the model moves by exactly the unmasked mean, a
device that drops after dealing its shares costs nothing, and what cannot work is refused."""

from __future__ import annotations

import math

import pytest
import torch

from fedge.server.engine.loop import Engine
from fedge.server.run.initial_model import initial_params
from fedge.server.settings import SettingsError
from fedge.tasks import make_task
from tests.server.engines import build_engine
from tests.server.in_process_grid import InProcessGrid

TASK = make_task("digits")
SECAGG = "secagg:bits=8,clip=0.2,weight-cap=256"


def _engine(tmp_path, **overrides) -> Engine:
    values = dict(rounds=2, clients_per_round=5, local_epochs=3, round_timeout=5.0, wait_for_nodes=1.0,
                  run_dir=str(tmp_path / "run"), secure_aggregation=SECAGG)
    values.update(overrides)
    return build_engine(values)


def test_secure_rounds_train_and_send_only_masked_uploads(tmp_path) -> None:
    engine = _engine(tmp_path)
    grid = InProcessGrid(5)
    start = initial_params(TASK, 42)
    before = engine.evaluate(start)["accuracy"]
    result = engine.run(grid, start)
    row = result.rows[-1]
    assert row.clients_used == 5 and not row.rejected, row.rejected
    assert row.accuracy > before + 0.2
    kinds = [m.metadata.message_type for m in grid.pushed]
    assert kinds.count("query.secagg") == 2 * 3 * 5 and kinds.count("train") == 2 * 5
    # the uplink holds the masked uploads (ring of 8 + 3 bits per coordinate) and the key exchange
    ring = row.extra["secagg_ring_bits"]
    assert ring == 11
    masked = 5 * (((engine.ctx.numel + 1) * ring + 7) // 8 + 17)  # + 1 weight digit, 17-byte header
    assert masked < row.uplink_bytes < masked + 5 * 10_000  # + keys, sealed shares and reveals
    # no device reported its example count or loss in clear
    assert row.train_loss is None


def test_a_device_dropping_after_sharing_is_recovered(tmp_path) -> None:
    """Partition 4 deals its shares and then crashes in training (its pairwise masks are in the
    others' uploads): the round still unmasks the sum of the four survivors."""
    engine = _engine(tmp_path, rounds=1)
    grid = InProcessGrid(5, node_config={4: {"fault": "crash"}})
    start = initial_params(TASK, 42)
    result = engine.run(grid, start)
    row = result.rows[-1]
    assert row.clients_used == 4
    assert [r["node"] for r in row.rejected] == [grid.node_id(4)]
    assert not torch.equal(result.model, start)
    assert row.accuracy > engine.evaluate(start)["accuracy"]


def test_random_k_on_a_shared_support_sends_a_quarter_and_still_trains(tmp_path) -> None:
    """``ratio=0.25``: every device masks the same quarter of the coordinates (the round's public
    support); the others wait in their residuals. A quarter of the masked bytes, and the model learns."""
    engine = _engine(tmp_path, rounds=6, secure_aggregation=f"{SECAGG},ratio=0.25")
    start = initial_params(TASK, 42)
    rows = engine.run(InProcessGrid(5), start).rows
    assert all(r.clients_used == 5 and not r.rejected for r in rows)
    # masked uploads of a quarter of the coordinates (+ the weight digit), bit-packed in the 11-bit ring
    quarter = math.ceil(0.25 * engine.ctx.numel)
    masked = 5 * (((quarter + 1) * 11 + 7) // 8 + 17)
    assert masked < rows[-1].uplink_bytes < masked + 5 * 10_000  # + keys, sealed shares, reveals
    # slower than dense (a quarter of the coordinates move per round; the rest wait in the residuals)
    assert rows[-1].accuracy > engine.evaluate(start)["accuracy"] + 0.2


def test_easgd_moves_its_center_by_the_unmasked_mean(tmp_path) -> None:
    engine = _engine(tmp_path, algorithm="easgd", rounds=3)
    grid = InProcessGrid(5)
    start = initial_params(TASK, 42)
    result = engine.run(grid, start)
    row = result.rows[-1]
    assert row.clients_used == 5 and not row.rejected
    assert row.extra["secagg_ring_bits"] == 11 and "center_distance" not in row.extra  # distances stay on the devices
    assert row.accuracy > engine.evaluate(start)["accuracy"] + 0.2


def test_identity_keys_are_pinned_on_both_sides(tmp_path) -> None:
    """A device that comes back with another identity key is dropped by the coordinator (which
    pinned the first one), and a device refuses a peer identity that differs from its own pin."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from flwr.app import ConfigRecord, Context, RecordDict

    from fedge.edge_client.secure_aggregation import _checked_identities
    from fedge.privacy.errors import AdvertisementError

    engine = _engine(tmp_path, rounds=2)
    grid = InProcessGrid(5)
    engine.algorithm.start(initial_params(TASK, 42))
    first = engine.step(grid, 1)
    assert first.clients_used == 5
    impostor = grid.node_id(2)
    del grid.contexts[impostor].state["fedge-identity"]  # a new key at the next use
    second = engine.step(grid, 2)
    assert second.clients_used == 4
    assert [r["node"] for r in second.rejected] == [impostor] and "pinned" in second.rejected[0]["reason"]

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    key = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    _checked_identities(context, {7: key})
    with pytest.raises(AdvertisementError, match="differs from the one pinned"):
        _checked_identities(context, {7: Ed25519PrivateKey.generate().public_key().public_bytes_raw()})
    assert isinstance(context.state["fedge-secagg-pins"], ConfigRecord)


@pytest.mark.parametrize("overrides, reason", [
    ({"algorithm": "gossip"}, "needs each device's update"),
    ({"algorithm": "fedbuff:concurrency=3,buffer=2"}, "asynchronously"),
    ({"aggregator": "median"}, "works on individual updates"),
    ({"aggregator": "sparse-mean"}, "works on individual updates"),
    ({"update_norm": "clip:max=1"}, "never sees"),
])
def test_what_needs_individual_updates_is_refused_before_the_run(tmp_path, overrides, reason) -> None:
    with pytest.raises(SettingsError, match=reason):
        _engine(tmp_path, **overrides)


def test_a_malformed_spec_is_refused(tmp_path) -> None:
    with pytest.raises(SettingsError, match="secure-aggregation"):
        _engine(tmp_path, secure_aggregation="secagg:bits=40")
