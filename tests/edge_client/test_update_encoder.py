import torch
from flwr.app import RecordDict

from fedge.compression import make_codec
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.update_encoder import encode_update, load_memory_state


def _encode(delta, codec, state, gen=None, round_=1):  # type: ignore[no-untyped-def]
    return encode_update(delta, codec, state, server_round=round_, seed=42, error_feedback=True, generator=gen)


def test_residual_persists_in_context_state_across_rounds() -> None:
    codec = make_codec("qsgd:bits=2,bucket=64,norm=max")
    state = NodeStore(RecordDict(), "fedavg")
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(500, generator=gen) for _ in range(3)]
    sent = torch.zeros(500)
    for delta in deltas:
        payload, norm = _encode(delta, codec, state, gen)
        sent += codec.decode(payload, 500)
        assert norm > 0
    residual = load_memory_state(state, codec, 500)["residual"]
    assert torch.allclose(sent + residual, sum(deltas), atol=1e-4)


def test_memory_resets_when_codec_or_model_changes() -> None:
    state = NodeStore(RecordDict(), "fedavg")
    codec = make_codec("qsgd:bits=2,bucket=64")
    _encode(torch.randn(100), codec, state)
    assert load_memory_state(state, codec, 100) is not None
    assert load_memory_state(state, make_codec("qsgd:bits=4,bucket=64"), 100) is None
    assert load_memory_state(state, codec, 101) is None


def test_without_error_feedback_nothing_is_stored() -> None:
    state = NodeStore(RecordDict(), "fedavg")
    encode_update(torch.randn(10), make_codec("fp16"), state, server_round=1, seed=0, error_feedback=False)
    assert state.keys() == []


def test_dgc_memory_survives_rounds_and_warms_up() -> None:
    codec = make_codec("dgc:ratio=0.01,sample=0,momentum=0.9,warmup=3")
    state = NodeStore(RecordDict(), "fedavg")
    sizes = []
    for round_ in (1, 2, 3, 4):
        payload, _ = _encode(torch.randn(10_000), codec, state, round_=round_)
        wire = codec.for_round(round_, 42)
        sizes.append(int((wire.decode(payload, 10_000) != 0).sum()))
    assert sizes == [2500, 625, 157, 100]  # 0.25^r until the final 1%
    saved = load_memory_state(state, codec, 10_000)
    assert set(saved) == {"u", "v"}


def test_shared_random_k_support_is_the_same_for_all_clients_of_a_round() -> None:
    codec = make_codec("randk:ratio=0.01,shared=true")
    a = codec.for_round(3, 42)
    b = codec.for_round(3, 42)
    c = codec.for_round(4, 42)
    x, y = torch.randn(5000), torch.randn(5000)
    assert torch.equal(a.decode(a.encode(x), 5000) != 0, b.decode(b.encode(y), 5000) != 0)
    assert not torch.equal(a.decode(a.encode(x), 5000) != 0, c.decode(c.encode(x), 5000) != 0)


def test_dgc_memory_of_a_client_that_skipped_rounds_follows_its_absent_policy() -> None:
    """Partial participation: the rounds since a client last sent reach its DGC memory."""
    update = torch.zeros(1000)
    update[:500] = torch.linspace(0.5, 1.0, 500)  # only the largest is sent; coordinate 0 stays in the memory
    for absent, expected_u in (("keep", 1.0), ("decay", 0.9**4), ("reset-momentum", 0.0), ("reset", 0.0)):
        codec = make_codec(f"dgc:ratio=0.001,sample=0,momentum=0.9,warmup=0,absent={absent}")
        state = NodeStore(RecordDict(), "fedavg")
        _encode(update, codec, state, round_=3)
        before = load_memory_state(state, codec, 1000)
        _encode(torch.zeros(1000), codec, state, round_=8)  # back five rounds later, with nothing new
        after = load_memory_state(state, codec, 1000)
        i = 0  # the smallest: never sent
        # age: u *= m^4 (decay); then u <- m u + 0 and v <- v + u
        u_seen = float(after["u"][i]) / (0.9 * float(before["u"][i]))
        assert abs(u_seen - expected_u) < 1e-5, absent
        kept_v = float(after["v"][i]) - float(after["u"][i])
        assert abs(kept_v - (0.0 if absent == "reset" else float(before["v"][i]))) < 1e-5, absent


def test_compact_memory_storage_keeps_the_residual_within_its_rounding() -> None:
    codec = make_codec("qsgd:bits=2,bucket=64,norm=max")
    delta = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    exact = NodeStore(RecordDict(), "fedavg")
    encode_update(delta, codec, exact, server_round=1, seed=42, error_feedback=True,
                  generator=torch.Generator().manual_seed(2))
    reference = load_memory_state(exact, codec, 10_000)["residual"]
    for storage, bytes_per_value, tolerance in (("fp16", 2, 1e-3), ("int8", 1, 1 / 127)):
        store = NodeStore(RecordDict(), "fedavg")
        encode_update(delta, codec, store, server_round=1, seed=42, error_feedback=True,
                      generator=torch.Generator().manual_seed(2), storage=storage)
        stored = load_memory_state(store, codec, 10_000)["residual"]
        error = float((stored - reference).abs().max()) / float(reference.abs().max())
        assert error <= tolerance, storage
        held = sum(len(a.data) for record in store._state.array_records.values() for a in record.values())  # noqa: SLF001
        assert held < 10_000 * bytes_per_value + 400, storage
