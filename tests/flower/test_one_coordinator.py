"""One coordinator design: what Fedge's own engine and a Flower app with ``fedge.flower`` send are the
same bytes, because each is one implementation with two thin adapters.

Uplink: the engine's device (``fedge.edge_client.local.encode``, what ``compression_mod`` calls for a FedAvg handler) and
``compression_mod`` encode the same update, with the same randomness, into the same payload, round
after round (the error-feedback memory evolves the same way), for qsgd, DGC and ``tcs``. Downlink:
the engine's downlink layer and ``compressed(..., downlink="lattice:...")`` are one layer
(``fedge.coordinator.downlink_layer``) whose adapters choose the base: from the engine's seeded start
model and a Flower app's named one, it sends each node the same lattice record for the same sequence
of models, catch-ups included. Asynchronous: FedBuff and
FedAsync, the engine's algorithms and ``fedge.flower``'s, get the same payloads from a device and
make the same versions from the same replies, stale drops included.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedge.compression import derive_seed
from fedge.edge_client import local
from fedge.edge_client.node_store import NodeStore
from fedge.aggregation.staleness import Staleness
from fedge.flower import FedAsync, FedBuff, compressed
from fedge.protocol.config_keys import ROUND_KEY
from fedge.protocol.layout import Layout
from fedge.flower.layered import CompressedStrategy
from fedge.protocol.records import DOWNLINK_RECORD, UPDATE_RECORD, read_payload
from fedge.protocol.round_config import RoundConfig
from fedge.server.algorithms.registry import make_algorithm
from fedge.server.engine.algorithm import Rejected, Reply, RunContext, Update
from fedge.coordinator.step import Outgoing, Step
from fedge.coordinator.downlink_layer import DownlinkLayer
from fedge.server.settings import RunSettings
from fedge.tasks import flatten_state, make_task, seeded_initial_params, tensor_sizes, unflatten_state
from tests.flower.test_compressed_strategy import NODES, Grid, _contexts, _exchange, _flat, _model, _user_app
from tests.flower.test_fedbuff_strategy import Clock, LatencyGrid

SEED = 7


def _dither(node: int, server_round: int) -> torch.Generator:
    """compression_mod's generator: (the wrapper's seed, the round, the node's partition or number)."""
    return torch.Generator().manual_seed(derive_seed(SEED, server_round, node, purpose="dither"))


@pytest.mark.parametrize("spec, downlink", [("qsgd:bits=4", "none"), ("dgc:ratio=0.05", "none"),
                                            ("tcs:extra=0.01,sample=0+qsgd:bits=4", "lattice:ratio=0.05")])
def test_the_engines_device_and_compression_mod_send_the_same_payload(monkeypatch, spec: str, downlink: str) -> None:
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
            generator = _dither(node, server_round)
            sizes = tensor_sizes(task.build_model().state_dict())
            engine_payload, _ = local.encode(delta, config, sizes, NodeStore(engine_state[node], "fedavg"), generator,
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
    engine = DownlinkLayer("lattice:ratio=0.05")  # as the engine's build() makes it: the seeded base
    engine.begin(start, tensor_sizes(template), seeded=True)
    wrapper = compressed(FedAvg(), uplink="qsgd:bits=4", downlink="lattice:ratio=0.05",
                         start="tests.flower.test_one_coordinator:start_model@0").downlink
    assert wrapper is not None
    g = torch.Generator().manual_seed(3)
    model = start.clone()
    for version in (1, 2, 3):
        nodes = [11, 13] if version == 2 else list(NODES)
        arrays = ArrayRecord({k: v.clone() for k, v in unflatten_state(model, template).items()})
        assert torch.equal(flatten_state(arrays.to_torch_state_dict()), model)
        ours = [Outgoing(n, RecordDict({"config": ConfigRecord()}), MessageType.TRAIN, model=model) for n in nodes]
        theirs = [Outgoing(n, RecordDict({"arrays": arrays, "config": ConfigRecord()}), MessageType.TRAIN,
                           model=model) for n in nodes]
        step = Step(version)
        engine.outgoing(step, ours)
        wrapper.outgoing(Step(version), theirs)
        for mine, sent in zip(ours, theirs, strict=True):
            record, got = mine.content.array_records[DOWNLINK_RECORD], sent.content.array_records[DOWNLINK_RECORD]
            assert "arrays" not in sent.content and list(got) == list(record)
            for name in record:
                assert (got[name].stype, got[name].shape, got[name].data) == \
                    (record[name].stype, record[name].shape, record[name].data), (version, mine.node, name)
            for layer, content in ((engine, mine.content), (wrapper, sent.content)):
                layer.arrived(step, Reply(mine.node, content))
        tally = step.layers["downlink"]
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


class _RecordingGrid(LatencyGrid):
    """The Flower side's traffic as events, in order: each message sent (its node and the version it
    carries) and each reply delivered (its node, payload and weight)."""

    def __init__(self, versions: list[np.ndarray], *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.versions = versions  # the models published so far (version 0 first)
        self.events: list[tuple[str, int, Any]] = []

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        messages = list(messages)
        for message in messages:
            self.events.append(("send", message.metadata.dst_node_id, len(self.versions) - 1))
            assert message.content.config_records["config"][ROUND_KEY] == len(self.versions)  # the engine's round
        return super().push_messages(messages)

    def pull_messages(self, ids):  # type: ignore[no-untyped-def]
        replies = super().pull_messages(ids)
        for reply in replies:
            self.events.append(("reply", reply.metadata.src_node_id, reply))
        return replies


@pytest.mark.parametrize("algorithm", ["fedbuff:concurrency=3,buffer=2,max-staleness=1",
                                       "fedasync:alpha=0.6,concurrency=3,max-staleness=1"])
def test_the_engines_async_algorithms_and_the_flower_wrappers_make_the_same_versions(monkeypatch, algorithm: str) -> None:
    """The same device replies, in the same order, through ``fedge.flower.FedBuff``/``FedAsync`` and
    through the engine's algorithm (admit, decode with its reply codec, absorb, close): the same
    versions, the same staleness tally, the same updates dropped as too stale. Node 13 is slow, so
    its updates arrive stale and some beyond the bound. The devices encode with the round the
    engine would name (version + 1), so each payload is what the same device sends the engine."""
    name = algorithm.split(":")[0]
    clock = Clock()
    flower_versions: list[np.ndarray] = []
    grid = _RecordingGrid(flower_versions, {n: _user_app() for n in NODES}, {11: 1.0, 12: 1.3, 13: 3.1}, clock)
    staleness = Staleness("poly", max_staleness=1)
    wrapper = (FedBuff(concurrency=3, buffer=2, uplink="qsgd:bits=4", staleness=staleness, seed=SEED)
               if name == "fedbuff" else
               FedAsync(concurrency=3, alpha=0.6, uplink="qsgd:bits=4", staleness=staleness, seed=SEED))
    arrays = _model()
    layout = Layout(arrays)
    wrapper.start(grid, initial_arrays=arrays, num_versions=6, train_config=ConfigRecord({"lr": 0.1}),
                  evaluate_fn=lambda v, a: flower_versions.append(layout.flatten(a)) or None,
                  clock=clock, sleep=clock.sleep)
    assert wrapper.dropped_stale >= 1 and not wrapper.refused  # node 13's later updates are too stale

    task = make_task("digits")
    template = task.build_model().state_dict()
    settings = RunSettings(algorithm=algorithm, codec="qsgd:bits=4", clients_per_round=3, seed=SEED)
    ctx = RunContext(settings=settings, task=task, template=template, numel=layout.numel, fp32_bytes=0,
                     nodes_expected=3)
    alg = make_algorithm(algorithm, ctx)
    alg.start(torch.from_numpy(flower_versions[0]))
    engine_versions, dropped, started = [flower_versions[0]], 0, {}
    device_state = {n: RecordDict() for n in NODES}  # the engine's device keeps its error memory here
    step = alg.open_step(1, [])
    for kind, node, what in grid.events:
        if len(engine_versions) == len(flower_versions):
            break
        if kind == "send":
            assert what == step.number - 1  # the version the message carries: the one being built, less one
            alg.configure(step, [node])
            started[node] = what
            continue
        reply = Reply(node, what.content, started=started[node])
        # the engine's device, given the model this message carried and the round the engine names
        received = layout.rebuild(flower_versions[started[node]], arrays)
        delta = torch.from_numpy(layout.flatten(_trained(node, started[node] + 1, received)) - layout.flatten(received))
        config = RoundConfig(round=started[node] + 1, task=task.spec, partitioning="iid", codec="qsgd:bits=4",
                             error_feedback=True, local_epochs=1, batch_size=32, lr=0.1, momentum=0.0, seed=SEED)
        generator = _dither(node, started[node] + 1)
        device_payload, _ = local.encode(delta.to(torch.float32), config, tensor_sizes(task.build_model().state_dict()),
                                         NodeStore(device_state[node], "fedavg"), generator)
        assert read_payload(what.content, UPDATE_RECORD) == device_payload, (node, started[node])
        try:
            alg.admit(step, reply)
        except Rejected:
            dropped += 1
            continue
        payload = read_payload(what.content, UPDATE_RECORD)
        vector = alg.reply_codec(step, reply).decode(payload, layout.numel)
        weight = float(what.content.metric_records["metrics"]["num-examples"]) if alg.weighted else 1.0
        alg.absorb(step, Update(node, vector, weight, {"train-loss": 0.0}, payload, what.content, started=reply.started))
        if alg.ready(step):
            outcome = alg.close(step)
            engine_versions.append(outcome.model.numpy().copy())
            step = alg.open_step(step.number + 1, [])
    assert len(engine_versions) == len(flower_versions) == 7
    for v, (ours, theirs) in enumerate(zip(engine_versions, flower_versions)):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6, err_msg=f"version {v}")
    assert dropped == wrapper.dropped_stale
