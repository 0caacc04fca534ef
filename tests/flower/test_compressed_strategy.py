"""``fedge.flower``: Flower's own strategies wrapped with ``compressed`` and a ClientApp with
``compression_mod``, message by message in-process (no engine): each wrapped aggregate equals what
the plain strategy computes on the updates decoded independently, mismatches are refused, and the
error-feedback memory carries over in the node's Context."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdam, FedAvg, FedMedian, FedProx

from fedge.compression import make_codec
from fedge.flower import compressed, compression_mod
from fedge.protocol.layout import Layout, LayoutError
from fedge.protocol.config_keys import CODEC_KEY, LAYOUT_KEY
from fedge.protocol.records import UPDATE_RECORD, read_payload
from fedge.tasks import make_task

NODES = [11, 12, 13]


class Grid:
    """What a strategy's configure step asks of a grid: the connected nodes."""

    def get_node_ids(self) -> list[int]:
        return list(NODES)


def _user_app(with_mod: bool = True, seen: dict[int, list[ArrayRecord]] | None = None,
              refusals: bool = False, resources: bool = False) -> ClientApp:
    from fedge.flower import refusal_mod, resource_mod

    app = ClientApp(mods=([resource_mod] if resources else []) + ([refusal_mod] if refusals else []) +
                    ([compression_mod] if with_mod else []))

    @app.train()
    def train(msg: Message, context: Context) -> Message:  # a user's body: weights in, weights out
        if seen is not None:  # the test keeps the model each message brought
            seen.setdefault(context.node_id, []).append(msg.content["arrays"])
        state = msg.content["arrays"].to_torch_state_dict()
        g = torch.Generator().manual_seed(context.node_id * 1000 + int(msg.content["config"].get("fedge.round", 0)))
        trained = {k: v + 0.01 * (context.node_id - 10) * torch.randn(v.shape, generator=g) if v.is_floating_point()
                   else v for k, v in state.items()}
        return Message(RecordDict({"arrays": ArrayRecord(trained),
                                   "metrics": MetricRecord({"num-examples": 10 * (context.node_id - 10),
                                                            "train_loss": 1.0})}), reply_to=msg)

    return app


def _model() -> ArrayRecord:
    return ArrayRecord(make_task("digits").build_model().state_dict())


def _contexts() -> dict[int, Context]:
    return {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={}) for n in NODES}


def _exchange(messages: list[Message], apps: dict[int, ClientApp], contexts: dict[int, Context]) -> list[Message]:
    replies = []
    for message in messages:
        message.metadata.__dict__["_message_id"] = message.object_id
        reply = apps[message.metadata.dst_node_id](message, contexts[message.metadata.dst_node_id])
        reply.metadata.__dict__["_src_node_id"] = message.metadata.dst_node_id
        replies.append(reply)
    return replies


def _flat(record: ArrayRecord) -> np.ndarray:
    return np.concatenate([a.numpy().astype(np.float32).ravel() for a in record.values() if a.numpy().dtype.kind == "f"])


def _independently_decoded(replies: list[Message], sent: ArrayRecord, spec: str, server_round: int) -> list[Message]:
    """Each reply's payload decoded here, with the codec and this test's own flattening."""
    numel = _flat(sent).size
    out = []
    for reply in replies:
        delta = make_codec(spec).for_round(server_round, 0).decode(read_payload(reply.content, UPDATE_RECORD), numel)
        flat, offset, arrays = _flat(sent) + delta.numpy(), 0, {}
        for name, array in sent.items():
            values = array.numpy()
            if values.dtype.kind == "f":
                arrays[name] = Array(flat[offset:offset + values.size].reshape(values.shape).astype(values.dtype))
                offset += values.size
            else:
                arrays[name] = array
        out.append(Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": reply.content["metrics"]}),
                           reply_to=Message(RecordDict(), dst_node_id=1, message_type="train")))
    return out


def _copy(replies: list[Message]) -> list[Message]:
    return [Message(RecordDict(dict(r.content.items())), reply_to=Message(RecordDict(), dst_node_id=1,
                                                                          message_type="train")) for r in replies]


@pytest.mark.parametrize("make", [lambda: FedAvg(), lambda: FedAdam(eta=0.05), lambda: FedMedian()],
                         ids=["FedAvg", "FedAdam", "FedMedian"])
@pytest.mark.parametrize("spec", ["qsgd:bits=4", "dgc:ratio=0.01,sample=0.05"])
def test_the_wrapped_aggregate_is_the_plain_strategys_on_the_decoded_updates(make, spec) -> None:
    arrays, config, grid = _model(), ConfigRecord({"lr": 0.1}), Grid()
    wrapped, plain = compressed(make(), uplink=spec), make()
    apps, contexts = {n: _user_app() for n in NODES}, _contexts()
    for server_round in (1, 2):
        messages = list(wrapped.configure_train(server_round, arrays, config, grid))
        assert len(messages) == 3 and all(m.content["config"][CODEC_KEY] == spec for m in messages)
        list(plain.configure_train(server_round, arrays, config, grid))  # stateful strategies (FedAdam) see it too
        replies = _exchange(messages, apps, contexts)
        assert all(UPDATE_RECORD in r.content and "arrays" not in r.content for r in replies)
        expected, _ = plain.aggregate_train(server_round, _independently_decoded(_copy(replies), arrays, spec, server_round))
        got, metrics = wrapped.aggregate_train(server_round, replies)
        assert got is not None and expected is not None and metrics is not None
        assert list(got.keys()) == list(arrays.keys())
        for name in arrays:
            np.testing.assert_allclose(got[name].numpy(), expected[name].numpy(), rtol=0, atol=1e-6)
        arrays = got
    # error feedback: what compression held back is in each node's Context, for its next round
    assert all("fedge/flower-uplink/memory" in c.state.array_records for c in contexts.values())


def test_the_update_is_the_codecs_size_not_the_models() -> None:
    arrays = _model()
    wrapped = compressed(FedAvg(), uplink="qsgd:bits=4")
    replies = _exchange(list(wrapped.configure_train(1, arrays, ConfigRecord(), Grid())),
                        {n: _user_app() for n in NODES}, _contexts())
    fp32 = sum(a.numpy().nbytes for a in arrays.values())
    sent = [len(read_payload(r.content, UPDATE_RECORD)) for r in replies]
    assert all(fp32 / size > 7.5 for size in sent), (fp32, sent)


def test_a_client_without_the_mod_or_a_corrupt_payload_is_refused_not_misdecoded(caplog) -> None:
    arrays = _model()
    wrapped = compressed(FedAvg(), uplink="qsgd:bits=4")
    apps = {11: _user_app(), 12: _user_app(with_mod=False), 13: _user_app()}
    replies = sorted(_exchange(list(wrapped.configure_train(1, arrays, ConfigRecord(), Grid())), apps, _contexts()),
                     key=lambda r: r.metadata.src_node_id)
    payload = bytearray(read_payload(replies[2].content, UPDATE_RECORD))
    payload[-5] ^= 0xFF
    from fedge.protocol.records import payload_record

    replies[2].content[UPDATE_RECORD] = payload_record(bytes(payload))
    aggregated, metrics = wrapped.aggregate_train(1, replies)
    assert aggregated is not None and metrics is not None and metrics["fedge-refused"] == 2
    assert metrics["fedge-failed.invalid"] == 2  # typed, as the engine counts them
    kept = replies[0].content["arrays"]  # node 11's update, decoded into its model: the round's only one
    assert all(np.array_equal(aggregated[name].numpy(), kept[name].numpy()) for name in kept)
    assert [node for _, node, _ in wrapped.refused] == [12, 13]
    assert "compression_mod" in wrapped.refused[0][2] and caplog.text.count("rejected update from node 13") == 1
    assert "refused the reply of node 13" not in caplog.text  # logged once, by the door


def test_a_model_other_than_the_one_described_is_refused_by_the_client() -> None:
    wrapped = compressed(FedAvg(), uplink="qsgd:bits=4")
    (message, *_) = list(wrapped.configure_train(1, _model(), ConfigRecord(), Grid()))
    message.content["config"][LAYOUT_KEY] = "0" * 16
    message.metadata.__dict__["_message_id"] = message.object_id
    with pytest.raises(LayoutError, match="layout"):  # Flower's runtime turns it into an error reply
        _user_app()(message, _contexts()[message.metadata.dst_node_id])


def test_an_unknown_codec_is_refused_when_wrapping() -> None:
    with pytest.raises(ValueError, match="uplink codec"):
        compressed(FedAvg(), uplink="nonsense:bits=4")


# ---- the lattice downlink through the wrapper ------------------------------------------------------


def _public(wrapped) -> ArrayRecord:  # type: ignore[no-untyped-def]
    layout = wrapped.downlink.layout  # the digits CNN: floating-point arrays only
    return layout.rebuild(wrapped.downlink.broadcast.public.numpy(), Layout.zeros(layout.spec))


def test_with_the_lattice_downlink_nodes_get_the_servers_public_copy_and_the_aggregate_is_exact() -> None:
    from fedge.protocol.config_keys import LAYOUT_SPEC_KEY
    from fedge.protocol.records import DOWNLINK_BASE_KEY, DOWNLINK_RECORD

    arrays, config, grid, spec = _model(), ConfigRecord({"lr": 0.1}), Grid(), "qsgd:bits=4"
    wrapped, plain = compressed(FedAvg(), uplink=spec, downlink="lattice:ratio=0.05"), FedAvg()
    seen: dict[int, list[ArrayRecord]] = {}
    apps, contexts = {n: _user_app(seen=seen) for n in NODES}, _contexts()
    fp32 = sum(len(a.data) for a in arrays.values())
    for server_round in (1, 2, 3):
        messages = list(wrapped.configure_train(server_round, arrays, config, grid))
        assert all("arrays" not in m.content and DOWNLINK_RECORD in m.content for m in messages)
        assert not wrapped.downlink.supports  # only a tcs uplink needs the changes' supports
        # no model goes out in fp32: the first message is a snapshot on a zero base with the model's
        # layout (names, shapes, dtypes); later rounds carry only a change
        assert not any(DOWNLINK_BASE_KEY in m.content[DOWNLINK_RECORD] for m in messages)
        assert all((LAYOUT_SPEC_KEY in m.content["config"]) == (server_round == 1) for m in messages)
        public = _public(wrapped)
        replies = _exchange(messages, apps, contexts)
        for node in NODES:  # the user's code got the server's public copy, bit for bit, in the model's layout
            got = seen[node][-1]
            assert list(got.keys()) == list(arrays.keys())
            assert all(np.array_equal(got[k].numpy(), public[k].numpy()) for k in arrays)
        # the updates (from the public copy the nodes hold) move the strategy's exact model
        expected, _ = plain.aggregate_train(server_round,
                                            _independently_decoded(_copy(replies), arrays, spec, server_round))
        got_arrays, metrics = wrapped.aggregate_train(server_round, replies)
        assert got_arrays is not None and expected is not None and metrics is not None
        for name in arrays:
            np.testing.assert_allclose(got_arrays[name].numpy(), expected[name].numpy(), rtol=0, atol=1e-6)
        if server_round > 1:  # a change of 5% of the coordinates: far below the fp32 model per node
            assert 0 < metrics["fedge-downlink-bytes"] < 0.25 * len(NODES) * fp32, metrics
        arrays = got_arrays


def test_what_a_lattice_version_did_not_carry_stays_in_the_exact_model_and_goes_out_later() -> None:
    """Round 1: every node moves every weight by +0.5, far more than a 20% change carries; later
    rounds: zero updates. The strategy's model keeps the whole move (its exact model), and the
    nodes' copies reach it version by version, to within half a lattice step (error feedback on the
    server). Decoding updates against the public copy instead lost the 80% the first version did not
    carry, for good."""
    app = ClientApp(mods=[compression_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        bump = 0.5 if int(msg.content["config"]["fedge.round"]) == 1 else 0.0
        moved = {k: v + bump if v.is_floating_point() else v
                 for k, v in msg.content["arrays"].to_torch_state_dict().items()}
        return Message(RecordDict({"arrays": ArrayRecord(moved), "metrics": MetricRecord({"num-examples": 1})}),
                       reply_to=msg)

    arrays, grid = _model(), Grid()
    target = _flat(arrays) + 0.5
    wrapped = compressed(FedAvg(), uplink="none", downlink="lattice:ratio=0.2")
    contexts, lag = _contexts(), []
    for server_round in range(1, 9):
        messages = list(wrapped.configure_train(server_round, arrays, ConfigRecord(), grid))
        if server_round > 1:
            lag.append(float(np.abs(_flat(_public(wrapped)) - target).max()))
        arrays, _ = wrapped.aggregate_train(server_round, _exchange(messages, {n: app for n in NODES}, contexts))
        np.testing.assert_allclose(_flat(arrays), target, rtol=0, atol=1e-5)
    half_step = float(wrapped.downlink.broadcast.steps.max()) / 2
    assert lag[0] > 0.4 and lag[-1] <= half_step + 1e-6, (lag, half_step)


def test_a_node_that_lost_its_copy_refuses_and_gets_a_snapshot_next_round() -> None:
    from fedge.protocol.config_keys import LAYOUT_SPEC_KEY
    from fedge.protocol.refusals import OutOfSyncError

    arrays, grid = _model(), Grid()
    wrapped = compressed(FedAvg(), uplink="qsgd:bits=4", downlink="lattice:ratio=0.05")
    apps, contexts = {n: _user_app() for n in NODES}, _contexts()
    arrays, _ = wrapped.aggregate_train(1, _exchange(list(wrapped.configure_train(1, arrays, ConfigRecord(), grid)),
                                                      apps, contexts))
    contexts[12] = Context(run_id=1, node_id=12, node_config={}, state=RecordDict(), run_config={})  # restarted
    messages = list(wrapped.configure_train(2, arrays, ConfigRecord(), grid))
    lost = next(m for m in messages if m.metadata.dst_node_id == 12)
    lost.metadata.__dict__["_message_id"] = lost.object_id
    with pytest.raises(OutOfSyncError, match="no base"):  # Flower's runtime turns it into an error reply
        apps[12](lost, contexts[12])
    others = _exchange([m for m in messages if m.metadata.dst_node_id != 12], apps, contexts)
    arrays, _ = wrapped.aggregate_train(2, others)  # node 12 did not answer: forgotten
    messages = list(wrapped.configure_train(3, arrays, ConfigRecord(), grid))
    assert {m.metadata.dst_node_id for m in messages if LAYOUT_SPEC_KEY in m.content["config"]} == {12}
    replies = _exchange(messages, apps, contexts)
    assert all(not r.has_error() for r in replies)
    assert wrapped.aggregate_train(3, replies)[0] is not None and not wrapped.refused


def test_an_unknown_downlink_is_refused_when_wrapping() -> None:
    with pytest.raises(ValueError, match="downlink codec"):
        compressed(FedAvg(), downlink="lattice:ratio=2")


@pytest.mark.parametrize("downlink", ["none", "lattice:ratio=0.05"])
@pytest.mark.parametrize("make", [lambda: FedAvg(), lambda: FedProx(proximal_mu=0.1)], ids=["FedAvg", "FedProx"])
def test_streaming_decodes_into_one_sum_and_equals_the_strategys_mean(make, downlink) -> None:
    arrays, config, grid = _model(), ConfigRecord({"lr": 0.1}), Grid()
    stream = compressed(make(), uplink="qsgd:bits=4", downlink=downlink, streaming=True)
    whole = compressed(make(), uplink="qsgd:bits=4", downlink=downlink)
    apps, contexts = {n: _user_app() for n in NODES}, _contexts()
    for server_round in (1, 2):
        messages = list(stream.configure_train(server_round, arrays, config, grid))
        list(whole.configure_train(server_round, arrays, config, grid))  # the same messages, the same state
        replies = _exchange(messages, apps, contexts)
        copies = _copy(replies)  # the same encoded replies for both (the codec's rounding is random)
        for copy, reply in zip(copies, replies, strict=True):
            copy.metadata.__dict__["_src_node_id"] = reply.metadata.src_node_id
        (a, metrics_a), (b, metrics_b) = stream.aggregate_train(server_round, replies), \
            whole.aggregate_train(server_round, copies)
        assert a is not None and b is not None and list(a.keys()) == list(b.keys())
        for name in a:
            np.testing.assert_allclose(a[name].numpy(), b[name].numpy(), rtol=0, atol=1e-6)
        assert dict(metrics_a) == pytest.approx(dict(metrics_b))
        arrays = a


@pytest.mark.parametrize("make", [lambda: FedAdam(eta=0.05), lambda: FedMedian()], ids=["FedAdam", "FedMedian"])
def test_streaming_is_refused_for_a_strategy_that_is_not_a_plain_mean(make) -> None:
    with pytest.raises(ValueError, match="weighted mean"):
        compressed(make(), streaming=True)


def test_a_malformed_layout_from_the_server_is_refused_by_the_node() -> None:
    from fedge.protocol.layout import Layout

    with pytest.raises(LayoutError, match="malformed"):
        Layout.zeros('[["w", [-1], "float32"]]')
    with pytest.raises(LayoutError, match="malformed"):
        Layout.zeros("not json")
    zeros = Layout.zeros(Layout(_model()).spec)
    assert Layout(zeros).digest == Layout(_model()).digest and not any(a.numpy().any() for a in zeros.values())


def _digits_start() -> torch.nn.Module:
    """A start model the test's 'app' can build: the digits CNN (seeded by the caller)."""
    return make_task("digits").build_model()


def test_with_a_named_start_model_nodes_build_it_and_no_model_goes_out_whole() -> None:
    from fedge.protocol.config_keys import LAYOUT_SPEC_KEY, START_KEY
    from fedge.protocol.records import DOWNLINK_BASE_KEY, DOWNLINK_RECORD

    start = f"{__name__}:_digits_start@7"
    torch.manual_seed(7)
    arrays = ArrayRecord(_digits_start().state_dict())  # the ServerApp's initial_arrays, built the same way
    seen: dict[int, list[ArrayRecord]] = {}
    wrapped = compressed(FedAvg(), uplink="qsgd:bits=4", downlink="lattice:ratio=0.05", start=start)
    apps, contexts, grid = {n: _user_app(seen=seen) for n in NODES}, _contexts(), Grid()
    messages = list(wrapped.configure_train(1, arrays, ConfigRecord(), grid))
    assert all(m.content["config"][START_KEY] == start and DOWNLINK_BASE_KEY not in m.content[DOWNLINK_RECORD]
               and LAYOUT_SPEC_KEY not in m.content["config"] for m in messages)
    fp32 = sum(len(a.data) for a in arrays.values())
    replies = _exchange(messages, apps, contexts)
    got, metrics = wrapped.aggregate_train(1, replies)
    assert metrics["fedge-downlink-bytes"] < 0.01 * len(NODES) * fp32  # the start model itself: not sent
    for node in NODES:  # version 0 is the start model, exactly
        assert all(np.array_equal(seen[node][-1][k].numpy(), arrays[k].numpy()) for k in arrays)
    # a node whose build differs (here: its state holds nothing and another seed is named) errs and
    # is sent the start model once
    wrapped_bad = compressed(FedAvg(), uplink="qsgd:bits=4", downlink="lattice:ratio=0.05",
                             start=f"{__name__}:_digits_start@8")
    (message, *_) = list(wrapped_bad.configure_train(1, arrays, ConfigRecord(), grid))
    message.metadata.__dict__["_message_id"] = message.object_id
    from fedge.protocol.refusals import MissingBaseError

    with pytest.raises(MissingBaseError, match="differs"):
        _user_app()(message, _contexts()[message.metadata.dst_node_id])
    # Flower answers for that node with an error reply: the server ships it the start model once, in fp32
    from flwr.app import Error

    failed = Message(Error(code=0, reason="MissingBaseError"), reply_to=message)
    failed.metadata.__dict__["_src_node_id"] = message.metadata.dst_node_id
    wrapped_bad.aggregate_train(1, [failed])
    again = [m for m in wrapped_bad.configure_train(2, arrays, ConfigRecord(), grid)
             if m.metadata.dst_node_id == message.metadata.dst_node_id]
    assert len(again) == 1 and DOWNLINK_BASE_KEY in again[0].content[DOWNLINK_RECORD]
    assert START_KEY not in again[0].content["config"] and LAYOUT_SPEC_KEY in again[0].content["config"]
    again[0].metadata.__dict__["_message_id"] = again[0].object_id
    context = _contexts()[message.metadata.dst_node_id]
    reply = _user_app()(again[0], context)  # it builds its copy on the shipped start model
    assert not reply.has_error() and "fedge/flower-downlink/lattice.base" in context.state.array_records
    with pytest.raises(ValueError, match="module:callable@seed"):
        compressed(FedAvg(), downlink="lattice:ratio=0.05", start="not a spec")


def test_a_tcs_uplink_sends_on_the_coordinates_the_downlink_moved_and_the_aggregate_is_exact() -> None:
    """Each node sends its values on the coordinates its last lattice change moved: here found
    independently, as where the public copy moved between rounds (none in round 1, a snapshot)."""
    spec = "tcs:extra=0.01,sample=0+qsgd:bits=4"
    arrays, config, grid = _model(), ConfigRecord({"lr": 0.1}), Grid()
    wrapped, plain = compressed(FedAvg(), uplink=spec, downlink="lattice:ratio=0.05"), FedAvg()
    apps, contexts = {n: _user_app() for n in NODES}, _contexts()
    before = None
    for server_round in (1, 2, 3):
        messages = list(wrapped.configure_train(server_round, arrays, config, grid))
        public = _public(wrapped)
        moved = np.zeros(0, dtype=np.int64) if before is None else np.flatnonzero(_flat(public) != _flat(before))
        assert (moved.size > 0) == (server_round > 1)
        replies = _exchange(messages, apps, contexts)
        decoded = []
        for reply in _copy(replies):  # this test's own decode, on the support it found, applied to the exact model
            delta = make_codec(spec).with_support(moved).decode(read_payload(reply.content, UPDATE_RECORD),
                                                                _flat(public).size)
            assert set(np.flatnonzero(delta.numpy())) - set(moved.tolist())  # the extras, outside it
            rebuilt = dict(arrays.items())
            flat, offset = _flat(arrays) + delta.numpy(), 0
            for name, array in arrays.items():
                if array.numpy().dtype.kind == "f":
                    size = array.numpy().size
                    rebuilt[name] = Array(flat[offset:offset + size].reshape(array.numpy().shape))
                    offset += size
            reply.content = RecordDict({"arrays": ArrayRecord(rebuilt), "metrics": reply.content["metrics"]})
            decoded.append(reply)
        expected, _ = plain.aggregate_train(server_round, decoded)
        got, metrics = wrapped.aggregate_train(server_round, replies)
        assert got is not None and expected is not None and metrics is not None and not wrapped.refused
        for name in arrays:
            np.testing.assert_allclose(got[name].numpy(), expected[name].numpy(), rtol=0, atol=1e-6)
        arrays, before = got, public


def test_a_tcs_reply_on_another_support_is_refused_and_tcs_needs_the_lattice_downlink(caplog) -> None:
    spec = "tcs:extra=0.01+qsgd:bits=4"
    with pytest.raises(ValueError, match="needs a lattice downlink"):
        compressed(FedAvg(), uplink=spec)
    arrays, grid = _model(), Grid()
    wrapped = compressed(FedAvg(), uplink=spec, downlink="lattice:ratio=0.05")
    apps, contexts = {n: _user_app() for n in NODES}, _contexts()
    for server_round in (1, 2):
        replies = _exchange(list(wrapped.configure_train(server_round, arrays, ConfigRecord(), grid)), apps, contexts)
        if server_round == 2:  # the server's record of node 12's support no longer matches what it sent
            wrapped.downlink.broadcast.supports[12] = wrapped.downlink.broadcast.supports[12][1:]
        arrays, _ = wrapped.aggregate_train(server_round, replies)
    assert [(r, n) for r, n, _ in wrapped.refused] == [(2, 12)]
    assert "did not get the same downlink" in wrapped.refused[0][2] and "rejected update from node 12" in caplog.text


def test_with_refusal_mod_a_node_that_lost_its_copy_says_so_by_kind_and_gets_the_model_again() -> None:
    """``refusal_mod`` first on a Flower app's ClientApp sends the device's typed refusals as refusal
    replies, and the wrapper's door (the engine's, ``fedge.coordinator.door``) hears their kind: a node
    that lost its lattice copy answers ``out-of-sync`` (without the mod: a bare client error), is
    counted so, and the next round sends it a snapshot it trains from."""
    from fedge.protocol.records import DOWNLINK_RECORD

    arrays, grid = _model(), Grid()
    wrapped = compressed(FedAvg(), uplink="qsgd:bits=4", downlink="lattice:ratio=0.05")
    apps, contexts = {n: _user_app(refusals=True) for n in NODES}, _contexts()
    metrics_of = {}
    for server_round in (1, 2, 3):
        if server_round == 2:  # node 12 loses its state (a reinstalled device): no copy, no layout
            contexts[12] = Context(run_id=1, node_id=12, node_config={}, state=RecordDict(), run_config={})
        messages = list(wrapped.configure_train(server_round, arrays, ConfigRecord(), grid))
        assert all(DOWNLINK_RECORD in m.content for m in messages)
        replies = _exchange(messages, apps, contexts)
        arrays, metrics_of[server_round] = wrapped.aggregate_train(server_round, replies)
    assert metrics_of[2]["fedge-failed.out-of-sync"] == 1 and "fedge-failed.client-error" not in metrics_of[2]
    assert [(r, n) for r, n, _ in wrapped.refused] == [(2, 12)]
    # round 1: a snapshot each; round 2: changes only; round 3: node 12's copy again, and it trains
    assert [metrics_of[r]["downlink_snapshot"] for r in (1, 2, 3)] == [3, 0, 1]
    assert not any(k.startswith("fedge-failed") for k in metrics_of[3])


def test_evaluate_replies_pass_the_one_door_a_refusal_is_left_out_and_its_kind_reaches_the_downlink() -> None:
    """``aggregate_evaluate`` passes its replies through the same door as a train round: the
    strategy aggregates the metrics of the replies it lets through and Flower's error replies (for
    it to count), never a device's refusal record (Flower's consistency check would refuse the whole
    round); a ``needs-base`` refusal has the downlink ship that node the base with its next model."""
    from flwr.app import Error

    from fedge.protocol.failures import FailureKind
    from fedge.protocol.records import DOWNLINK_BASE_KEY, DOWNLINK_RECORD
    from fedge.protocol.refusals import refusal_content

    arrays, grid = _model(), Grid()
    wrapped = compressed(FedAvg(), uplink="qsgd:bits=4", downlink="lattice:ratio=0.05")
    apps, contexts = {n: _user_app() for n in NODES}, _contexts()
    arrays, _ = wrapped.aggregate_train(1, _exchange(list(wrapped.configure_train(1, arrays, ConfigRecord(), grid)),
                                                     apps, contexts))
    messages = list(wrapped.configure_evaluate(1, arrays, ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in messages) == NODES
    replies = []
    for message in messages:
        message.metadata.__dict__["_message_id"] = message.object_id
        node = message.metadata.dst_node_id
        content = {11: RecordDict({"metrics": MetricRecord({"num-examples": 10, "accuracy": 0.75})}),
                   12: refusal_content(FailureKind.NEEDS_BASE, "the base built here differs"),
                   13: Error(code=0, reason="boom")}[node]
        reply = Message(content, reply_to=message)
        reply.metadata.__dict__["_src_node_id"] = node
        replies.append(reply)
    metrics = wrapped.aggregate_evaluate(1, replies)
    assert metrics is not None and metrics["accuracy"] == 0.75 and metrics["fedge-downlink-bytes"] > 0
    again = {m.metadata.dst_node_id: m for m in wrapped.configure_train(2, arrays, ConfigRecord(), grid)}
    assert DOWNLINK_BASE_KEY in again[12].content[DOWNLINK_RECORD]  # needs-base: the base, once
    assert DOWNLINK_BASE_KEY not in again[11].content[DOWNLINK_RECORD]


def test_with_a_tcs_uplink_evaluation_carries_the_model_whole_and_leaves_the_copies_to_the_train_rounds() -> None:
    """A ``tcs`` update travels on the coordinates its node's train message moved. An evaluation
    message through the lattice would bring every copy current between rounds, so the next train
    message would move nothing and every update would lose its support (seen: 0 coordinates in
    rounds 2-4, against 1,139-1,915 without evaluation). Evaluation messages carry the strategy's
    arrays (counted in the downlink's bytes), and every train round's supports and uplink bytes are
    those of the same run without evaluation."""
    spec = "tcs:extra=0.01,sample=0+qsgd:bits=4"

    def run(evaluate: bool) -> tuple[list[tuple[dict[int, int], float]], list[float]]:
        arrays, grid = _model(), Grid()
        wrapped = compressed(FedAvg(fraction_evaluate=1.0 if evaluate else 0.0), uplink=spec,
                             downlink="lattice:ratio=0.05")
        apps, contexts, seen = {}, _contexts(), []
        for node in NODES:
            apps[node] = _user_app()

            @apps[node].evaluate()
            def evaluate_handler(msg: Message, context: Context) -> Message:
                seen.append(_flat(msg.content["arrays"]))
                return Message(RecordDict({"metrics": MetricRecord({"num-examples": 10, "accuracy": 0.5})}),
                               reply_to=msg)

        rounds, evaluated = [], []
        for server_round in (1, 2, 3, 4):
            messages = list(wrapped.configure_train(server_round, arrays, ConfigRecord({"lr": 0.1}), grid))
            supports = {n: len(s) for n, s in wrapped.downlink.broadcast.supports.items()}
            arrays, metrics = wrapped.aggregate_train(server_round, _exchange(messages, apps, contexts))
            assert metrics is not None and not wrapped.refused
            rounds.append((supports, metrics["fedge-uplink-bytes"]))
            messages = list(wrapped.configure_evaluate(server_round, arrays, ConfigRecord(), grid))
            if evaluate:
                seen.clear()
                metrics = wrapped.aggregate_evaluate(server_round, _exchange(messages, apps, contexts))
                assert len(seen) == len(NODES) and all(np.array_equal(s, _flat(arrays)) for s in seen)  # the exact model
                evaluated.append(metrics["fedge-downlink-bytes"])
        return rounds, evaluated

    plain, _ = run(evaluate=False)
    rounds, evaluated = run(evaluate=True)
    assert rounds == plain and all(n > 0 for n in plain[1][0].values())
    whole = sum(len(array.data) for array in _model().values())  # fp32 arrays, .npy headers included
    assert evaluated == [len(NODES) * whole] * 4 and whole > 4 * _flat(_model()).size  # every node, every round
