import pytest
import torch
from flwr.app import RecordDict

from fedge.aggregation.broadcast import Broadcast
from fedge.compression import make_codec
from fedge.edge_client.node_store import NodeStore
from fedge.edge_client.public_copy import OutOfSyncError, PublicCopy


def test_client_copy_equals_server_copy_and_tracks_the_model() -> None:
    codec = make_codec("qsgd:bits=4,bucket=64")
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(1000, generator=gen)
    server = Broadcast(codec, params)
    copy = PublicCopy(NodeStore(RecordDict(), "fedavg"), "downlink")
    copy.set(server.public, 0)
    for round_ in range(1, 30):
        if round_ < 20:
            params = params + 0.1 * torch.randn(1000, generator=gen)  # training moves the model
        server.advance(params, round_, gen)
        client = copy.apply(codec, server.delta, round_ - 1, round_)
        assert torch.equal(client, server.public)  # bit-identical copies: nothing drifts
    # once the model stops moving, server-side error feedback closes the gap
    assert (params - server.public).norm() / params.norm() < 1e-2


def test_sync_bookkeeping() -> None:
    server = Broadcast(make_codec("fp16"), torch.zeros(4))
    server.advance(torch.ones(4), 1)
    assert not server.is_current(7)  # unknown node: full model
    server.confirm(7)
    server.advance(torch.ones(4) * 2, 2)
    assert server.is_current(7)
    server.forget(7)
    assert not server.is_current(7)


def test_out_of_sync_change_is_refused() -> None:
    codec = make_codec("fp16")
    copy = PublicCopy(NodeStore(RecordDict(), "fedavg"), "downlink")
    with pytest.raises(OutOfSyncError):
        copy.apply(codec, codec.encode(torch.zeros(3)), 0, 1)
    copy.set(torch.zeros(3), 4)
    with pytest.raises(OutOfSyncError, match="version 4"):
        copy.apply(codec, codec.encode(torch.zeros(3)), 5, 6)
