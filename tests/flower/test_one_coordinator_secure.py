"""One coordinator design, secure aggregation with distributed DP: the engine's layers and the
``fedge.flower.secure(..., differential_privacy=...)`` wrapper drive the same devices (a user's
ClientApp with :func:`fedge.edge_client.secure_mod`) through the same bytes both ways and release
the same model.

Every random byte of a round is made reproducible here, keyed by who draws it (the node and the
exchange it answers, or the coordinator), so the two coordinators' runs can be compared byte for
byte although the coordinators make their own messages in their own order: the devices' key pairs
and identity keys, their mask seeds, the Shamir polynomials, the rounding and the Skellam noise,
and the session's run id. Production draws all of them from the OS CSPRNG.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pytest
import torch
from Crypto.Protocol import SecretSharing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

import fedge.edge_client.secure_aggregation as device_side
import fedge.privacy.secagg_device as secagg_device
import fedge.coordinator.dp_mechanisms as dp_layer
from fedge.flower import secure, secure_mod
from fedge.protocol.layout import Layout
from fedge.protocol.records import UPDATE_RECORD, read_payload
from fedge.protocol.secagg import SECAGG_RECORD, secure_stage
from fedge.tasks import flatten_state, make_task, unflatten_state
from tests.server.engines import build_engine
from tests.server.in_process_grid import InProcessGrid

SPEC = "secagg:bits=12,clip=0.5,weight-cap=64"
DP = "gaussian:noise=0.8,clip=1.0,delta=1e-5"
NODES, SEED, ROUNDS = 4, 42, 2
RUN_ID = bytes(range(16))


class _Entropy:
    """Random bytes from a stream per drawer: ``key`` is set while a device answers a message."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] = ("coordinator",)
        self.drawn: dict[tuple[Any, ...], int] = {}

    def __call__(self, n: int) -> bytes:
        index = self.drawn.get(self.key, 0)
        self.drawn[self.key] = index + 1
        return hashlib.shake_256(repr((self.key, index)).encode()).digest(n)


def _reproducible(monkeypatch: pytest.MonkeyPatch) -> _Entropy:
    entropy = _Entropy()
    monkeypatch.setattr(os, "urandom", entropy)
    monkeypatch.setattr(dp_layer, "_os_entropy", entropy)
    monkeypatch.setattr(SecretSharing, "rng", entropy)

    class X25519(X25519PrivateKey):  # what the device module calls: generate() from the stream
        @staticmethod
        def generate() -> X25519PrivateKey:
            return X25519PrivateKey.from_private_bytes(entropy(32))

    class Ed25519(Ed25519PrivateKey):
        @staticmethod
        def generate() -> Ed25519PrivateKey:
            return Ed25519PrivateKey.from_private_bytes(entropy(32))

    monkeypatch.setattr(secagg_device, "X25519PrivateKey", X25519)
    monkeypatch.setattr(device_side, "Ed25519PrivateKey", Ed25519)
    return entropy


def _update(node: int, server_round: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(node * 1000 + server_round)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g).clamp(-4, 4) if v.is_floating_point() else v
            for k, v in state.items()}


class _Devices:
    """A user's ClientApp behind ``secure_mod`` on every node, recording what crosses the wire: each
    secure-aggregation record a node receives and each record it sends back, per round and exchange."""

    def __init__(self, entropy: _Entropy) -> None:
        self.entropy = entropy
        self.down: dict[tuple[int, int, str], dict[str, bytes]] = {}
        self.up: dict[tuple[int, int, str], bytes | dict[str, bytes]] = {}
        self.rounds: dict[int, int] = {}
        app = ClientApp(mods=[secure_mod])

        @app.train()
        def train(msg: Message, context: Context) -> Message:  # a user's body: weights in, weights out
            trained = _update(context.node_id, self.rounds[context.node_id], msg.content["arrays"].to_torch_state_dict())
            return Message(RecordDict({"arrays": ArrayRecord(trained),
                                       "metrics": MetricRecord({"num-examples": 10, "train_loss": 1.0})}), reply_to=msg)

        self.app = app

    def __call__(self, msg: Message, context: Context) -> Message:
        record = msg.content.config_records[SECAGG_RECORD]
        stage = secure_stage(msg) or "masked"
        server_round = int(record["round"])
        self.rounds[context.node_id] = server_round
        key = (server_round, context.node_id, stage)
        self.down[key] = _bytes(record)
        self.entropy.key, before = key, self.entropy.key
        try:
            reply = self.app(msg, context)
        finally:
            self.entropy.key = before
        assert not reply.has_error(), reply.error
        if stage == "masked":
            self.up[key] = read_payload(reply.content, UPDATE_RECORD)
        else:
            self.up[key] = {f"{n}.{k}": v for n, r in reply.content.config_records.items() for k, v in _bytes(r).items()}
        return reply


def _bytes(record: ConfigRecord) -> dict[str, bytes]:
    """A config record's content: each value's bytes (a number's repr) by name."""
    return {name: bytes(value) if isinstance(value, (bytes, bytearray)) else repr(value).encode()
            for name, value in record.items()}


class _Grid(InProcessGrid):
    """The in-process grid with the ``send_and_receive`` a user's ServerApp calls."""

    def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
        messages = list(messages)
        ids = self.push_messages(messages)
        sender = {i: m.metadata.dst_node_id for i, m in zip(ids, messages)}
        replies = self.pull_messages(ids)
        for reply in replies:  # what Flower's runtime stamps on a reply
            reply.metadata.__dict__["_src_node_id"] = sender[reply.metadata.reply_to_message_id]
        return replies


def _flower_run(monkeypatch: pytest.MonkeyPatch, start: torch.Tensor) -> tuple[_Devices, list[np.ndarray], list[int]]:
    devices = _Devices(_reproducible(monkeypatch))
    grid = _Grid(NODES, app=devices)
    template = make_task("digits").build_model().state_dict()
    arrays = ArrayRecord(unflatten_state(start, template))
    wrapped = secure(FedAvg(fraction_train=1.0), SPEC, seed=SEED, differential_privacy=DP)
    wrapped.session.run_id = RUN_ID
    models, uplink = [], []
    for server_round in range(1, ROUNDS + 1):
        messages = list(wrapped.configure_train(server_round, arrays, ConfigRecord({"lr": 0.1}), grid))
        replies = grid.send_and_receive(messages)
        arrays, metrics = wrapped.aggregate_train(server_round, replies)
        assert arrays is not None and metrics["fedge-secagg-survivors"] == NODES, metrics
        models.append(Layout(arrays).flatten(arrays))
        uplink.append(metrics["fedge-uplink-bytes"])
    return devices, models, uplink


def _engine_run(monkeypatch: pytest.MonkeyPatch, tmp_path,
                start: torch.Tensor) -> tuple[_Devices, list[np.ndarray], list[int]]:
    devices = _Devices(_reproducible(monkeypatch))
    engine = build_engine(dict(rounds=ROUNDS, clients_per_round=NODES, round_timeout=5.0, wait_for_nodes=1.0,
                               run_dir=str(tmp_path / "run"), seed=SEED, secure_aggregation=SPEC,
                               differential_privacy=DP))
    engine.layer("secure-aggregation").session.run_id = RUN_ID
    models: list[np.ndarray] = []
    engine.on_row = lambda row: models.append(engine.algorithm.params.numpy().copy())
    rows = engine.run(_Grid(NODES, app=devices), start.clone()).rows
    assert [r.clients_used for r in rows] == [NODES] * ROUNDS
    return devices, models, [r.uplink_bytes for r in rows]


def test_secure_aggregation_with_distributed_dp_is_the_same_bytes_and_model_in_both_coordinators(
        monkeypatch, tmp_path) -> None:
    """Two rounds, four devices, q = 1 (every device sampled in both coordinators): every
    secure-aggregation record each device receives (advertise, share, the masked round's plan and
    shares, unmask) and every record it sends back (its advertisement, sealed shares, masked upload
    with its Skellam noise, reveals) is the same bytes whichever coordinator drives it, and both
    release the same model (the same noisy sum over q N), and count the same uplink bytes (one
    tally: the masked uploads as they arrived and the stages' records)."""
    task = make_task("digits")
    torch.manual_seed(0)
    start = flatten_state(task.build_model().state_dict())
    with monkeypatch.context() as patch:
        flower_devices, flower_models, flower_uplink = _flower_run(patch, start)
    with monkeypatch.context() as patch:
        engine_devices, engine_models, engine_uplink = _engine_run(patch, tmp_path, start)

    stages = {k[2] for k in flower_devices.up}
    assert {"advertise", "share", "masked", "unmask"} <= stages, stages
    assert sorted(engine_devices.down) == sorted(flower_devices.down)
    for key in sorted(flower_devices.down):
        assert engine_devices.down[key] == flower_devices.down[key], f"server to device differs at {key}"
        assert engine_devices.up[key] == flower_devices.up[key], f"device to server differs at {key}"
    assert len(engine_models) == len(flower_models) == ROUNDS
    for server_round, (ours, theirs) in enumerate(zip(engine_models, flower_models), start=1):
        assert not np.array_equal(ours, start.numpy()), "the round released nothing"
        np.testing.assert_array_equal(ours, theirs, err_msg=f"round {server_round}")
    assert engine_uplink == flower_uplink and all(b > 0 for b in engine_uplink), (engine_uplink, flower_uplink)
