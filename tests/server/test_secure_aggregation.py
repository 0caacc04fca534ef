"""Secure aggregation in the round engine (in-process grid: fast; the real-process run is in
tests/integration/test_secure_aggregation.py): the model moves by exactly the unmasked mean, a
device that drops after dealing its shares costs nothing, and what cannot work is refused."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict

from fedge.protocol import METRICS_RECORD, UPDATE_RECORD, payload_record, read_payload

from fedge.server.engine.loop import Engine
from fedge.server.run.initial_model import initial_params
from fedge.server.settings import SettingsError
from fedge.tasks import make_task
from fedge.protocol.secagg import secure_stage
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
    from fedge.edge_client.app import app as fedge_app

    sent: list[Message] = []

    def recording(msg: Message, context: Context) -> Message:
        reply = fedge_app(msg, context)
        if msg.metadata.message_type == "train" and secure_stage(msg) is None:  # the masked round
            sent.append(reply)
        return reply

    engine = _engine(tmp_path)
    grid = InProcessGrid(5, app=recording)
    start = initial_params(TASK, 42)
    before = engine.evaluate(start)["accuracy"]
    result = engine.run(grid, start)
    row = result.rows[-1]
    assert row.clients_used == 5 and not row.rejected, row.rejected
    assert row.accuracy > before + 0.2
    kinds = [m.metadata.message_type for m in grid.pushed]
    stages = [secure_stage(m) for m in grid.pushed]
    # every message a train message (Flower's SecAgg+ convention): 3 exchanges and the masked round
    assert set(kinds) == {"train"} and len(stages) - stages.count(None) == 2 * 3 * 5 and stages.count(None) == 2 * 5
    # the uplink holds the masked uploads (ring of 8 + 3 bits per coordinate) and the key exchange
    ring = row.extra["secagg_ring_bits"]
    assert ring == 11
    masked = 5 * (((engine.ctx.numel + 1) * ring + 7) // 8 + 17)  # + 1 weight digit, 17-byte header
    assert masked < row.uplink_bytes < masked + 5 * 10_000  # + keys, sealed shares and reveals
    # no device reported its example count or loss in clear: each train reply's metrics are exactly
    # num-examples 1, its training and reply times and the upload's (public, fixed) size, and its
    # array is the masked upload
    assert row.train_loss is None and len(sent) == 10
    from fedge.privacy.messages import masked_size
    from fedge.privacy.shared_grid import SharedGrid

    size = masked_size(engine.ctx.numel + SharedGrid(8, 0.2, 256).weight_digits, ring)  # 2 weight digits
    for reply in sent:
        metrics = dict(reply.content.metric_records[METRICS_RECORD])
        assert set(metrics) == {"num-examples", "train-seconds", "seconds", "payload-bytes"}, metrics
        assert metrics["num-examples"] == 1 and metrics["payload-bytes"] == size
        payload = read_payload(reply.content, UPDATE_RECORD)
        assert len(payload) == size and payload[:4] == b"FSM1"


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


def _tampering(node_of_partition: int, change: Callable[[RecordDict], None]) -> Callable[[Message, Context], Message]:
    """The real ClientApp, with one device's train replies changed after it built them."""
    from fedge.edge_client.app import app as fedge_app

    def app(msg: Message, context: Context) -> Message:
        reply = fedge_app(msg, context)
        if (context.node_config["partition-id"] == node_of_partition and msg.metadata.message_type == "train"
                and secure_stage(msg) is None):  # the masked round, not one of the exchanges
            change(reply.content)
        return reply
    return app


def _bad_metrics(content: RecordDict) -> None:
    content[METRICS_RECORD]["num-examples"] = -3


def _short_body(content: RecordDict) -> None:
    payload = read_payload(content, UPDATE_RECORD)
    content[UPDATE_RECORD] = payload_record(payload[:-5])


def _smuggled_record(content: RecordDict) -> None:
    content["state"] = MetricRecord({"x": 1.0})


@pytest.mark.parametrize("change, reason", [
    (_bad_metrics, "num-examples must be a positive integer"),
    (_short_body, "malformed masked upload"),
    (_smuggled_record, "unknown record names"),
])
def test_a_bad_masked_reply_is_rejected_at_the_door_with_its_reason(tmp_path, change, reason) -> None:
    """A secure round's reply passes the same door as a clear one: screened, its metrics checked,
    its size checked against the plan, and refused with the reason before anything is unmasked.
    The device dealt its shares, so the others' sum is still recovered without it."""
    engine = _engine(tmp_path, rounds=1)
    grid = InProcessGrid(5, app=_tampering(3, change))
    start = initial_params(TASK, 42)
    (row,) = engine.run(grid, start).rows
    (refused,) = row.rejected
    assert refused["node"] == grid.node_id(3) and refused["kind"] == "invalid" and reason in refused["reason"], refused
    assert row.clients_used == 4 and row.extra["failures"] == {"invalid": 1}
    assert row.accuracy > engine.evaluate(start)["accuracy"]


def test_a_plugin_algorithm_masks_through_the_device_layers_exactly_as_fedavg(tmp_path, monkeypatch) -> None:
    """``fedavg_decay`` (examples/plugins) builds its device handler on the device's layers: under
    secure aggregation its devices mask, and with decay 1 its unmasked sum, hence its model, is
    bit-identical to FedAvg's."""
    from pathlib import Path

    from fedge.protocol.plugins import load_plugins

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples" / "plugins"))
    load_plugins("decaying_fedavg")
    plugin = dict(plugins="decaying_fedavg", algorithm="fedavg_decay:decay=1.0", rounds=2)
    decaying = _engine(tmp_path / "plugin", **plugin)
    fedavg = _engine(tmp_path / "fedavg", rounds=2)
    start = initial_params(TASK, 42)
    grid = InProcessGrid(5)
    got = decaying.run(grid, start)
    kinds = [m.metadata.message_type for m in grid.pushed]
    stages = [secure_stage(m) for m in grid.pushed if secure_stage(m) is not None]
    assert kinds.count("train.plugin") == 2 * 5 and kinds.count("train") == len(stages) == 2 * 3 * 5
    assert all(r.clients_used == 5 and not r.rejected for r in got.rows)
    expected = fedavg.run(InProcessGrid(5), start)
    assert torch.equal(got.model, expected.model)


def test_a_plugin_whose_handler_bypasses_the_device_layers_is_refused_before_the_run(tmp_path) -> None:
    from fedge.server.algorithms.fedavg import FedAvg
    from fedge.server.algorithms.registry import _PLUGINS, register_algorithm

    class OwnHandler(FedAvg):
        name = "fedavg_own_handler"

    def train(msg: Message, context: Context) -> Message:  # encodes its update itself
        raise NotImplementedError

    register_algorithm(OwnHandler, train)
    try:
        with pytest.raises(SettingsError, match="does not send its update through Fedge's upload layers"):
            _engine(tmp_path, algorithm="fedavg_own_handler")
        with pytest.raises(SettingsError, match="nothing clips it on the device"):
            _engine(tmp_path / "dp", algorithm="fedavg_own_handler", secure_aggregation="none",
                    differential_privacy="gaussian:noise=1.0,clip=1.0")
    finally:
        del _PLUGINS["fedavg_own_handler"]


def test_the_run_id_is_random_and_a_resumed_run_keeps_it(tmp_path) -> None:
    """Privacy II, L1. Every signature and share is bound to the run id; it was sha256(seed, run
    directory's name), so a rerun with the same seed and name reused every label. Now it is random
    and checkpointed."""
    first = _engine(tmp_path / "a", rounds=1)
    other = _engine(tmp_path / "b", rounds=1)  # same seed, same directory name ("run")
    ids = [engine.layer("secure-aggregation").session.run_id for engine in (first, other)]
    assert ids[0] != ids[1] and all(len(i) == 16 for i in ids)
    first.run(InProcessGrid(5), initial_params(TASK, 42))
    resumed = _engine(tmp_path / "a", rounds=2)
    resumed.run(InProcessGrid(5), initial_params(TASK, 42))
    assert resumed.layer("secure-aggregation").session.run_id == ids[0]


def test_a_malformed_first_advertisement_does_not_pin_a_key(tmp_path) -> None:
    """Privacy II, L2. The coordinator pinned a node's identity key before checking its
    advertisement, so one malformed (or forged) first reply locked the node out of the run. Now
    only a key whose advertisement verified is pinned: the node takes part in the next round."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fedge.edge_client.app import app as fedge_app
    from fedge.protocol.secagg import SECAGG_RECORD

    forged = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    target, first_round = 3, {"done": False}

    def app(msg: Message, context: Context) -> Message:
        reply = fedge_app(msg, context)
        record = reply.content.config_records.get(SECAGG_RECORD) if reply.has_content() else None
        if (context.node_config["partition-id"] == target and record is not None and "ad" in record
                and not first_round["done"]):
            first_round["done"] = True
            record["identity"], record["ad"] = forged, b"not an advertisement"
        return reply

    engine = _engine(tmp_path, rounds=2)
    grid = InProcessGrid(5, app=app)
    first, second = engine.run(grid, initial_params(TASK, 42)).rows
    assert first.clients_used == 4 and [r["node"] for r in first.rejected] == [grid.node_id(target)]
    assert second.clients_used == 5 and not second.rejected, second.rejected


def test_a_secure_round_that_cannot_be_planned_is_skipped_not_a_crash(tmp_path) -> None:
    """Privacy II, L7. A round with fewer than two devices (here the only one connected) cannot be
    masked; it used to crash the run (the plan was built outside the round's error handling). Now
    the round is recorded as failed, the model is unchanged and the run goes on; one device per
    round is refused before the run starts."""
    engine = _engine(tmp_path, rounds=2, clients_per_round=2, min_replies=1, wait_for_nodes=1.0)
    start = initial_params(TASK, 42)
    result = engine.run(InProcessGrid(1), start)
    assert [r.round for r in result.rows] == [1, 2] and all(r.clients_used == 0 for r in result.rows)
    assert all("at least two devices" in r.rejected[-1]["reason"] for r in result.rows)
    assert torch.equal(result.model, start)
    with pytest.raises(SettingsError, match="clients-per-round >= 2"):
        _engine(tmp_path / "one", clients_per_round=1, min_replies=1)


def test_a_restarted_device_keeps_its_identity_and_its_pins(tmp_path) -> None:
    """Privacy II, L3. The identity key and the peer pins lived only in ``context.state``, which the
    node's state file does not hold: a restarted device came back with a new identity (and was
    dropped for the rest of the run) and trusted any peer key again. With a state directory both
    are saved there, 0600, and a fresh process (a new Context) finds them."""
    import stat

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fedge.edge_client.secure_aggregation import _checked_identities, identity_of
    from fedge.privacy.errors import AdvertisementError

    def fresh() -> Context:  # what a restarted SuperNode's ClientApp gets
        return Context(run_id=1, node_id=7, node_config={"state-dir": str(tmp_path)}, state=RecordDict(), run_config={})

    peer = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    first = fresh()
    key = identity_of(first).public_key().public_bytes_raw()
    _checked_identities(first, {9: peer})
    again = fresh()
    assert identity_of(again).public_key().public_bytes_raw() == key
    with pytest.raises(AdvertisementError, match="pinned"):
        _checked_identities(again, {9: Ed25519PrivateKey.generate().public_key().public_bytes_raw()})
    for name in ("secagg-identity.key", "secagg-pins.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600


def _issued_federation(tmp_path, nodes: int, rogue: tuple[int, ...] = ()):  # type: ignore[no-untyped-def]
    """A CA, one node key per device with its endorsement; devices in ``rogue`` hold an endorsement
    from another CA (an identity the operator did not issue)."""
    from fedge.deploy.certs import init_ca, make_node_key

    certs, other = tmp_path / "certs", tmp_path / "rogue-ca"
    init_ca(certs)
    init_ca(other)
    config = {}
    for i in range(nodes):
        key = make_node_key(other if i in rogue else certs, f"device-{i}")
        config[i] = {"secagg-auth-key": str(key.private_key), "secagg-endorsement": str(key.endorsement),
                     "secagg-issuer": str(certs / "ca.crt")}
    return certs / "ca.crt", config


def test_with_an_issuer_identities_are_checked_and_the_consistency_round_runs(tmp_path) -> None:
    """``issuer=ca.crt``: every device presents a credential from the operator's CA, checks its
    peers' credentials, signs the survivor set and checks a quorum of signatures before it reveals.
    A device whose endorsement comes from another CA is refused, the others' sum is still exact."""
    ca, config = _issued_federation(tmp_path, 5, rogue=(2,))
    engine = _engine(tmp_path, rounds=2, secure_aggregation=f"{SECAGG},issuer={ca}")
    grid = InProcessGrid(5, node_config=config)
    start = initial_params(TASK, 42)
    result = engine.run(grid, start)
    for row in result.rows:
        assert row.clients_used == 4 and row.extra["secagg_consistency"] is True
        assert [r["node"] for r in row.rejected] == [grid.node_id(2)]
        assert "not endorsed by the operator's CA" in row.rejected[0]["reason"]
    stages = [secure_stage(m) for m in grid.pushed if secure_stage(m) is not None]
    # advertise (5), share, consistency and unmask (4 each), per round
    assert len(stages) == 2 * (5 + 3 * 4) and stages.count("consistency") == 2 * 4
    assert result.rows[-1].accuracy > engine.evaluate(start)["accuracy"] + 0.2


def test_a_device_with_an_issued_identity_refuses_a_round_that_trusts_on_first_use(tmp_path) -> None:
    """No downgrade: a coordinator without ``issuer=`` gets no advertisement from a device the
    operator issued an identity to; and a device with no identity cannot join an issued round."""
    _, config = _issued_federation(tmp_path, 5)
    engine = _engine(tmp_path, rounds=1)
    row = engine.run(InProcessGrid(5, node_config={0: config[0]}), initial_params(TASK, 42)).rows[0]
    assert row.clients_used == 4
    assert "trusts identities on first use" in row.rejected[0]["reason"]
    ca, _ = _issued_federation(tmp_path / "second", 1)
    engine = _engine(tmp_path / "third", rounds=1, secure_aggregation=f"{SECAGG},issuer={ca}")
    row = engine.run(InProcessGrid(5), initial_params(TASK, 42)).rows[0]
    assert row.clients_used == 0 and all("has none" in r["reason"] for r in row.rejected[:5])


def test_the_coordinator_keeps_its_identity_pins_across_a_restart(tmp_path) -> None:
    """Privacy II: pins were in memory only, so a restarted coordinator trusted any key again. They
    are checkpointed with the run id; a device presenting another key after the resume is refused."""
    first = _engine(tmp_path, rounds=1)
    grid = InProcessGrid(5)
    first.run(grid, initial_params(TASK, 42))
    pins = dict(first.layer("secure-aggregation").session.pins)
    assert len(pins) == 5
    resumed = _engine(tmp_path, rounds=2)
    row = resumed.run(InProcessGrid(5), initial_params(TASK, 42)).rows[-1]  # fresh devices: new keys
    assert resumed.layer("secure-aggregation").session.pins == pins
    assert row.round == 2 and row.clients_used == 0
    assert len(row.rejected) >= 5 and all("another identity key" in r["reason"] for r in row.rejected[:5])


def test_secure_aggregation_with_differential_privacy_adds_the_noise_inside_the_ring(tmp_path) -> None:
    """Distributed DP: devices clip, scale, round and add Skellam noise before masking; the
    coordinator never sees a noiseless sum, only divides by q N and accounts (Skellam RDP at the
    round's noise V, whoever took part). With five devices the noise dominates the signal, so the
    released change of the model is, coordinate by coordinate, the summed noise divided by q N: its
    standard deviation must be sqrt(5 mu_local) / (s q N) within 10% (the signal adds at most
    C^2 / d to the variance, under 1% here). Rows report a finite, growing epsilon, and the masked
    uploads are exactly the packed ring the plan sized for the noise (no weight digits)."""
    from fedge.privacy.dp_spec import parse_differential_privacy
    from fedge.privacy.distributed_dp import round_noise

    dp = "gaussian:noise=0.5,clip=1.0,delta=1e-5"
    engine = _engine(tmp_path, rounds=2, clients_per_round=5, local_epochs=1, differential_privacy=dp)
    models: list[torch.Tensor] = []
    engine.on_row = lambda row: models.append(engine.algorithm.params.clone())
    start = initial_params(TASK, 42)
    rows = engine.run(InProcessGrid(5), start).rows
    params = round_noise(parse_differential_privacy(dp), engine.ctx.numel, 5)  # each of 5 adds V / 5
    assert rows[0].clients_used == 5
    predicted = math.sqrt(5 * params.local_variance) / params.scale / 5
    measured = float((models[0] - start).std())
    assert 0.9 < measured / predicted < 1.1, (measured, predicted)
    assert all(r.extra["dp_mechanism"] == "skellam" for r in rows)
    epsilons = [r.extra["dp_epsilon"] for r in rows]
    assert all(math.isfinite(e) for e in epsilons) and 0 < epsilons[0] < epsilons[1]
    # against the coordinator (which knows who took part) nothing is amplified: the worst device's
    # epsilon is its own rounds' plain Skellam mechanism at the devices' noise in the sum
    ledger = engine.layer("dp").mechanism.coordinator
    assert [r.extra["dp_coordinator_rounds"] for r in rows] == [1, 2]
    assert sum(ledger.rounds(n) for n in ledger.devices) == sum(r.clients_used for r in rows)
    assert rows[-1].extra["dp_epsilon_coordinator"] == max(ledger.epsilon_of(n) for n in ledger.devices) > 0
    for row in rows:
        used = row.clients_used
        assert row.extra["dp_topped_up_devices"] == 5 - used
        ring = row.extra["secagg_ring_bits"]
        assert ring == params.ring_bits(5)
        masked = used * ((engine.ctx.numel * ring + 7) // 8 + 17)  # 17-byte header, no weight digits
        assert masked < row.uplink_bytes < masked + used * 10_000


def test_under_distributed_dp_the_released_noise_is_central_dps_at_the_same_effective_noise(tmp_path) -> None:
    """The two paths side by side on the same five devices (q = 1): central DP at z' = z D2 / (s C)
    (the noise multiplier times the rounding's norm inflation) and distributed DP at z release
    model changes whose standard deviation, over the digits CNN's 38,282 coordinates, agrees within
    3% (each estimate's relative standard error is 0.4%; the signal adds under 0.3%)."""
    from fedge.privacy.distributed_dp import round_noise
    from fedge.privacy.dp_spec import parse_differential_privacy

    z = 0.5
    params = round_noise(parse_differential_privacy(f"gaussian:noise={z},clip=1.0"), 38_282, 1)
    effective = z * params.l2_bound / (params.scale * params.clip)
    spreads = {}
    for mode, dp, secure in (("central", f"gaussian:noise={effective},clip=1.0,delta=1e-5", "none"),
                             ("distributed", f"gaussian:noise={z},clip=1.0,delta=1e-5", SECAGG)):
        engine = _engine(tmp_path / mode, rounds=1, local_epochs=1, differential_privacy=dp, secure_aggregation=secure)
        start = initial_params(TASK, 42)
        engine.run(InProcessGrid(5), start)
        spreads[mode] = float((engine.algorithm.params - start).std())
    assert 0.97 < spreads["distributed"] / spreads["central"] < 1.03, spreads


def test_a_resumed_distributed_dp_run_keeps_each_devices_spending_against_the_coordinator(tmp_path) -> None:
    """The per-device ledger is checkpointed with the amplified one: after a resume a device's
    rounds before the crash still count against the coordinator, and none counts twice."""
    dp = "gaussian:noise=0.5,clip=1.0,delta=1e-5"
    grid = InProcessGrid(5)  # the same devices (their identity keys) on both sides of the restart
    first = _engine(tmp_path, rounds=1, local_epochs=1, differential_privacy=dp)
    first.run(grid, initial_params(TASK, 42))
    before = {n: first.layer("dp").mechanism.coordinator.rounds(n) for n in first.layer("dp").mechanism.coordinator.devices}
    resumed = _engine(tmp_path, rounds=2, local_epochs=1, differential_privacy=dp)
    rows = resumed.run(grid, initial_params(TASK, 42)).rows
    ledger = resumed.layer("dp").mechanism.coordinator
    assert sum(before.values()) == 5 and rows[-1].extra["dp_coordinator_rounds"] == 2
    assert sum(ledger.rounds(n) for n in ledger.devices) == 5 + rows[-1].clients_used


def test_distributed_dp_refuses_what_it_cannot_account_for(tmp_path) -> None:
    with pytest.raises(SettingsError, match="random-k"):
        _engine(tmp_path / "random-k", secure_aggregation=f"{SECAGG},ratio=0.5", differential_privacy="gaussian:noise=1")
    with pytest.raises(SettingsError, match="adaptive clipping"):
        _engine(tmp_path / "adaptive", clients_per_round=30,
                differential_privacy="gaussian:noise=0.5,adaptive=true")


def test_an_unmasked_sum_outside_the_grid_is_discarded_not_applied() -> None:
    """Audit M3, what can be checked. A hostile device adds arbitrary ring values to its masked
    upload (here after masking, which changes nothing: the masks cancel either way). Pushed past
    what ``count`` honest devices can sum to in a coordinate, or pulling the weights below one
    example per device (the attack that scales the mean up to the weight cap), the sum is refused
    and the round changes nothing. A shift that stays inside the bounds is not caught (SECURITY.md)."""
    import numpy as np

    from fedge.privacy.errors import UnmaskError
    from fedge.privacy.messages import decode_masked, encode_masked
    from fedge.coordinator.secure_round import check_range
    from tests.privacy.secagg_round import deal_shares, make_plan

    plan = make_plan(5, 16, bits=4, weight_cap=8)
    rng = np.random.default_rng(0)

    def round_with(offset: np.ndarray) -> tuple[np.ndarray, int]:
        devices, server, inbox = deal_shares(plan)
        uploads = {}
        for node, device in devices.items():
            levels = plan.grid.quantize(rng.uniform(-0.5, 0.5, 16), 4, rng)
            uploads[node] = device.masked_input(inbox[node], levels)
        hostile = plan.participants[0]
        raw = decode_masked(uploads[hostile], hostile, plan.length, plan.bits).astype(np.int64)
        uploads[hostile] = encode_masked(hostile, ((raw + offset) % (1 << plan.bits)).astype(np.uint32), plan.bits)
        survivors = server.receive_masked(uploads)
        return server.unmask({n: devices[n].unmask(survivors) for n in survivors})

    honest, count = round_with(np.zeros(plan.length, np.int64))
    check_range(plan, honest, count)  # weights 5 x 4 = 20, levels within bounds
    huge = np.zeros(plan.length, np.int64)
    huge[3] = (1 << plan.bits) - 1 - 5 * plan.grid.top  # lands above count * top
    with pytest.raises(UnmaskError, match="outside the grid"):
        check_range(plan, *round_with(huge))
    drain = np.zeros(plan.length, np.int64)
    drain[-1] = -(5 * 4 - 2)  # the weights' sum pulled down to 2 < 5 devices
    with pytest.raises(UnmaskError, match="weights sum to"):
        check_range(plan, *round_with(drain))
    subtle = np.zeros(plan.length, np.int64)
    subtle[-1] = -(5 * 4 - 5)  # down to exactly one example per device: inside the bounds
    check_range(plan, *round_with(subtle))


def test_under_distributed_dp_a_noisy_sum_beyond_its_bounds_is_discarded() -> None:
    """The same check with distributed noise: the ring was sized for n devices at their norm bound
    plus the noise's tail; a sum beyond that in any coordinate is refused."""
    import numpy as np

    from fedge.privacy.distributed_dp import SkellamParams, encode
    from fedge.privacy.errors import UnmaskError
    from fedge.privacy.keys import RoundContext
    from fedge.privacy.plan import SecAggPlan
    from fedge.privacy.shared_grid import SharedGrid
    from fedge.coordinator.secure_round import check_noisy_range

    noise = SkellamParams(clip=1.0, scale=32.0, local_variance=100.0, dimension=64)
    plan = SecAggPlan(RoundContext(b"r", 1), (1, 2, 3, 4), SharedGrid(8, 0.2, 1), 64, graph_seed=1, noise=noise)
    rng = np.random.default_rng(0)
    total = np.zeros(64, dtype=np.int64)
    for _ in range(4):
        total = (total + encode(rng.normal(size=64), noise, plan.bits, rng)) % (1 << plan.bits)
    check_noisy_range(plan, total.astype(np.uint32), 4)
    from fedge.privacy.distributed_dp import skellam_tail

    bound = 4 * noise.coordinate_bound + skellam_tail(4 * noise.local_variance, 64)
    total[5] = bound + 1  # within the ring (2^bits >= 2 bound + 1), beyond what 4 devices can send
    with pytest.raises(UnmaskError, match="beyond"):
        check_noisy_range(plan, total.astype(np.uint32), 4)


def test_one_endorsement_binds_one_participant(tmp_path) -> None:
    """Privacy audit 2, N2: a node key can bind any number of identities. A colluding device that
    joins twice with its one endorsement (two SuperNodes, one node key and name) is refused the
    second time by the coordinator; a device shown two peers with one endorsement refuses the round."""
    from pathlib import Path

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fedge.edge_client.secure_aggregation import _credentialed
    from fedge.privacy.credentials import CredentialError, bind_identity, load_issuer, load_node_key

    ca, config = _issued_federation(tmp_path, 5)
    config[4] = dict(config[0])  # device 4 clones device 0's node key and endorsement
    engine = _engine(tmp_path, rounds=1, secure_aggregation=f"{SECAGG},issuer={ca}")
    grid = InProcessGrid(5, node_config=config)
    row = engine.run(grid, initial_params(TASK, 42)).rows[0]
    assert row.clients_used == 4
    assert [r["node"] for r in row.rejected] == [grid.node_id(4)]
    assert "one endorsement, one participant" in row.rejected[0]["reason"]
    # a device's own check: two identities bound by one node key are refused, whoever forwards them
    key, endorsement = load_node_key(config[0]["secagg-auth-key"]), Path(config[0]["secagg-endorsement"]).read_bytes()
    raw = {n: Ed25519PrivateKey.generate().public_key().public_bytes_raw() for n in (7, 8)}
    credentials = {n: bind_identity(key, endorsement, raw[n]) for n in raw}
    with pytest.raises(CredentialError, match="same endorsed node key"):
        _credentialed(raw, credentials, load_issuer(ca))
    assert set(_credentialed({7: raw[7]}, {7: credentials[7]}, load_issuer(ca))) == {7}


def test_a_revoked_device_is_refused_by_the_coordinator_and_by_its_peers(tmp_path) -> None:
    """Privacy audit 2, N9: an endorsement worked forever. The operator revokes device 2
    (``fedge certs revoke``): the coordinator, reading the CA-signed list beside ``ca.crt``,
    refuses its identity and the others' round runs; a device that is forwarded the revoked
    credential refuses it too."""
    from pathlib import Path

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fedge.deploy.certs import revoke_node
    from fedge.edge_client.secure_aggregation import _credentialed
    from fedge.privacy.credentials import REVOCATIONS_FILE, CredentialError, bind_identity, load_issuer, load_node_key

    ca, config = _issued_federation(tmp_path, 5)
    engine = _engine(tmp_path, rounds=2, secure_aggregation=f"{SECAGG},issuer={ca}")

    publish = engine.publish

    def revoke_after_the_first_round(grid, closed, result):  # type: ignore[no-untyped-def]
        publish(grid, closed, result)  # the operator revokes device 2 while the run goes on
        if not (ca.parent / REVOCATIONS_FILE).exists():
            revoke_node(ca.parent, "device-2")

    engine.publish = revoke_after_the_first_round  # type: ignore[method-assign]
    grid = InProcessGrid(5, node_config=config)
    first, second = engine.run(grid, initial_params(TASK, 42)).rows
    assert first.clients_used == 5 and not first.rejected
    assert second.clients_used == 4  # no restart: the coordinator reads the list every round
    assert [r["node"] for r in second.rejected] == [grid.node_id(2)]
    assert "revoked by the operator" in second.rejected[0]["reason"]
    key, endorsement = load_node_key(config[2]["secagg-auth-key"]), Path(config[2]["secagg-endorsement"]).read_bytes()
    raw = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    with pytest.raises(CredentialError, match="revoked"):
        _credentialed({9: raw}, {9: bind_identity(key, endorsement, raw)}, load_issuer(ca))


def _each_stage_asked_twice(tmp_path, forge: bool) -> None:  # type: ignore[no-untyped-def]
    """Every device gets each consistency and unmask message twice, the second on a copy of its state
    from before the first (a concurrent fork), and must refuse the second; with ``forge``, between
    the two, a message of another run id and one of round + 4, which must fail at the plan check
    and leave the markers alone. The round still unmasks."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from fedge.edge_client.app import app as fedge_app
    from fedge.privacy.errors import ProtocolError
    from fedge.protocol.secagg import SECAGG_RECORD, plan_from_record

    ca, config = _issued_federation(tmp_path, 4)
    for i in range(4):
        config[i]["state-dir"] = str(tmp_path / f"device-{i}")
    refused: list[str] = []

    def fork_of(context):  # type: ignore[no-untyped-def]
        return Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                       state=RecordDict(dict(context.state.items())), run_config=context.run_config)

    def twice(msg, context):  # type: ignore[no-untyped-def]
        record = msg.content.config_records.get(SECAGG_RECORD)
        stage = plan_from_record(record)[1] if record is not None else None
        fork = fork_of(context)
        reply = fedge_app(msg, context)
        if stage in ("consistency", "unmask"):
            for key, value in ((("run-id", b"\x01" * 16), ("round", int(record["round"]) + 4)) if forge else ()):
                forged = ConfigRecord({**dict(record), key: value})
                with pytest.raises(ProtocolError, match="no secure-aggregation state"):
                    fedge_app(Message(RecordDict({SECAGG_RECORD: forged}), dst_node_id=msg.metadata.dst_node_id,
                                      message_type=msg.metadata.message_type), fork_of(fork))
            with pytest.raises(ProtocolError, match="answered already"):
                fedge_app(msg, fork)
            refused.append(stage)
        return reply

    engine = _engine(tmp_path, rounds=1, clients_per_round=4, secure_aggregation=f"{SECAGG},issuer={ca}")
    row = engine.run(InProcessGrid(4, app=twice, node_config=config), initial_params(TASK, 42)).rows[0]
    assert row.clients_used == 4 and not row.rejected
    assert sorted(refused) == ["consistency"] * 4 + ["unmask"] * 4


def test_a_second_message_for_one_stage_is_refused(tmp_path) -> None:
    """Privacy audit 2, N10: Flower starts a task per pulled message (the warm executor forks each)
    from one saved state, so two consistency or unmask messages of one round could both be answered:
    two survivor sets signed, or both kinds of a device's shares revealed. The marker in each
    device's state directory refuses the second."""
    _each_stage_asked_twice(tmp_path, forge=False)


def test_a_message_of_another_run_or_a_later_round_does_not_erase_a_stage_marker(tmp_path) -> None:
    """Privacy audit 3, F3: the marker of a stage used to be pruned by round number before the plan
    was matched to the saved round, so a third message (another run id, or round + 4) erased the real
    round's marker and a forked second message was answered again. Now such a message fails at the
    plan check and touches no marker: the second answer is still refused, for every device."""
    _each_stage_asked_twice(tmp_path, forge=True)
