import torch
from flwr.app import RecordDict

from compression import make_codec
from edge_client.update_encoder import encode_update, load_residual


def test_residual_persists_in_context_state_across_rounds() -> None:
    codec = make_codec("qsgd:bits=2,bucket=64,norm=max")
    state = RecordDict()
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(500, generator=gen) for _ in range(3)]
    sent = torch.zeros(500)
    for delta in deltas:
        payload, norm = encode_update(delta, codec, state, error_feedback=True, generator=gen)
        sent += codec.decode(payload, 500)
        assert norm > 0
    residual = load_residual(state, codec, 500)
    assert residual is not None
    assert torch.allclose(sent + residual, sum(deltas), atol=1e-4)


def test_residual_resets_when_codec_or_model_changes() -> None:
    state = RecordDict()
    codec = make_codec("qsgd:bits=2,bucket=64")
    encode_update(torch.randn(100), codec, state, error_feedback=True)
    assert load_residual(state, codec, 100) is not None
    assert load_residual(state, make_codec("qsgd:bits=4,bucket=64"), 100) is None
    assert load_residual(state, codec, 101) is None


def test_without_error_feedback_nothing_is_stored() -> None:
    state = RecordDict()
    encode_update(torch.randn(10), make_codec("fp16"), state, error_feedback=False)
    assert len(state) == 0
