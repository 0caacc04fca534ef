"""One coordinator design: what Fedge's own engine and a Flower app with ``fedge.flower`` send are the
same bytes, because each is one implementation with two thin adapters.

Uplink: the engine's device (``fedge.edge_client.local.encode``, what the FedAvg handler calls) and
``compression_mod`` encode the same update, with the same randomness, into the same payload, round
after round (the error-feedback memory evolves the same way), for qsgd, DGC and ``tcs``. Downlink:
the engine's downlink layer and ``compressed(..., downlink="lattice:...")`` send each node the same
lattice record for the same sequence of models, catch-ups included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg

import fedge.edge_client.compression_mod as client_mod
from fedge.edge_client import local
from fedge.edge_client.node_store import NodeStore
from fedge.flower import compressed
from fedge.protocol.layout import Layout
from fedge.flower.strategy import CompressedStrategy
from fedge.protocol.records import DOWNLINK_RECORD, UPDATE_RECORD, read_payload
from fedge.protocol.round_config import RoundConfig
from fedge.server.engine.layers.downlink import Downlink, _StepTally
from fedge.tasks import flatten_state, make_task, seeded_initial_params, unflatten_state
from tests.flower.test_compressed_strategy import NODES, Grid, _contexts, _exchange, _flat, _task, _user_app  # noqa: F401

SEED = 7
FIXED = (12345).to_bytes(8, "little")  # what compression_mod's os.urandom returns here: its generator's seed


@pytest.mark.parametrize("spec, downlink", [("qsgd:bits=4", "none"), ("dgc:ratio=0.05", "none"),
                                            ("tcs:extra=0.01,sample=0+qsgd:bits=4", "lattice:ratio=0.05")])
def test_the_engines_device_and_compression_mod_send_the_same_payload(monkeypatch, spec: str, downlink: str) -> None:
    monkeypatch.setattr(client_mod.os, "urandom", lambda n: FIXED[:n])
    task = make_task("digits")
    seen: dict[int, list[ArrayRecord]] = {}
    wrapped: CompressedStrategy = compressed(FedAvg(), uplink=spec, downlink=downlink, seed=SEED)
    apps, contexts = {n: _user_app(seen=seen) for n in NODES}, _contexts()
    engine_state = {n: RecordDict() for n in NODES}  # the engine's devices keep their memory here
    arrays, before = ArrayRecord(task.build_model().state_dict()), None
    for server_round in (1, 2, 3):
        messages = list(wrapped.configure_train(server_round, arrays, ConfigRecord({"lr": 0.1}), Grid()))
        replies = _exchange(messages, apps, contexts)
        public = seen[NODES[0]][-1]  # the copy the nodes trained from (the public one, with a lattice)
        support = None
        if downlink != "none":  # the coordinates the change moved (none in round 1: a snapshot)
            support = (np.zeros(0, dtype=np.int64) if before is None
                       else np.flatnonzero(_flat(public) != _flat(before)).astype(np.int64))
        for reply in replies:
            node = reply.metadata.src_node_id
            received, trained = seen[node][-1], _trained(node, server_round, seen[node][-1])
            layout = Layout(received)
            delta = torch.from_numpy(layout.flatten(trained) - layout.flatten(received)).to(torch.float32)
            config = RoundConfig(round=server_round, task=task.spec, partitioning="iid", codec=spec,
                                 error_feedback=True, local_epochs=1, batch_size=32, lr=0.1, momentum=0.0, seed=SEED)
            generator = torch.Generator().manual_seed(int.from_bytes(FIXED, "little") >> 1)
            engine_payload, _ = local.encode(delta, config, task, NodeStore(engine_state[node], "fedavg"), generator,
                                             support=support)
            assert read_payload(reply.content, UPDATE_RECORD) == engine_payload, (node, server_round)
        arrays, _ = wrapped.aggregate_train(server_round, replies)
        assert arrays is not None and not wrapped.refused
        before = public


def _trained(node: int, server_round: int, received: ArrayRecord) -> ArrayRecord:
    """What ``_user_app``'s body returns for ``received`` (the same seeded step)."""
    state = received.to_torch_state_dict()
    g = torch.Generator().manual_seed(node * 1000 + server_round)
    return ArrayRecord({k: v + 0.01 * (node - 10) * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                        for k, v in state.items()})


def test_the_engines_downlink_and_the_wrappers_send_the_same_lattice_records() -> None:
    """Same base (the start model every node builds), same models: the same record to each node,
    version by version; node 12 misses version 2 and both send it the same catch-up at version 3."""
    task = make_task("digits")
    template = task.build_model().state_dict()
    start = seeded_initial_params(task, SEED)
    engine = Downlink("lattice:ratio=0.05", task, template, SEED, init="")
    wrapper = compressed(FedAvg(), uplink="qsgd:bits=4", downlink="lattice:ratio=0.05",
                         start="tests.flower.test_one_coordinator:start_model@0").downlink
    g = torch.Generator().manual_seed(3)
    model = start.clone()
    for version in (1, 2, 3):
        nodes = [11, 13] if version == 2 else list(NODES)
        arrays = ArrayRecord({k: v.clone() for k, v in unflatten_state(model, template).items()})
        assert torch.equal(flatten_state(arrays.to_torch_state_dict()), model)
        engine.publish(model, version)
        wrapper.public(arrays, fresh=True)
        tally = _StepTally()
        for node in nodes:
            _, record = engine.model_record(model, node, tally)
            message = Message(RecordDict({"arrays": arrays, "config": ConfigRecord()}), dst_node_id=node,
                              message_type=MessageType.TRAIN)
            (sent,) = wrapper.attach([message], arrays)
            theirs = sent.content.array_records[DOWNLINK_RECORD]
            assert list(theirs) == list(record)
            for name in record:
                mine = record[name]
                assert (theirs[name].stype, theirs[name].shape, theirs[name].data) == \
                    (mine.stype, mine.shape, mine.data), (version, node, name)
            engine.replied(node, version)
            wrapper.broadcast.confirm(node, version)  # type: ignore[union-attr]
            wrapper.sent.pop(node, None)
        kinds = {kind: count for kind, count in tally.messages.items() if count}
        assert kinds == ({"snapshot": 3} if version == 1 else {"current": 2} if version == 2
                         else {"current": 2, "catch-up": 1}), (version, kinds)
        model = model + 0.02 * torch.randn(model.shape, generator=g)


def start_model() -> torch.nn.Module:
    """The start model a Flower app's nodes would build (``start=``): the engine's seeded one."""
    task = make_task("digits")
    model = task.build_model()
    model.load_state_dict(unflatten_state(seeded_initial_params(task, SEED), model.state_dict()))
    return model
