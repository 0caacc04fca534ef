"""A leaf's sum and the root's merge: exact for FedAvg with a lossless codec, error feedback at the
leaf for a lossy one, every sum taken once, and a wire record the root checks before it merges."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.aggregation.partial import Partial
from fedge.aggregation.streaming_mean import StreamingMean
from fedge.aggregation.tiers import LeafKey, LeafSum, LeafUplink, RootInbox
from fedge.compression import PayloadError, make_codec
from fedge.protocol.leaf_sum import LEAF_RECORD, LeafSumError, leaf_sum_record, read_leaf_sum
from fedge.protocol.records import UPDATE_RECORD, payload_record

NUMEL, SEED = 300, 5


def _leaf_partial(updates: list[tuple[torch.Tensor, float]]) -> Partial:
    mean = StreamingMean(NUMEL)
    for vector, weight in updates:
        mean.add(vector, weight)
    return mean.partial()


def _through_the_wire(leaf_sum: LeafSum, codec: str) -> LeafSum:
    content = leaf_sum_record(round=leaf_sum.key.round, leaf=leaf_sum.key.leaf, codec=codec,
                              payload=leaf_sum.payload, weight=leaf_sum.weight, count=leaf_sum.count,
                              planned=leaf_sum.planned, noised=leaf_sum.noised)
    fields = read_leaf_sum(content, round=leaf_sum.key.round, codec=codec)
    return LeafSum(LeafKey(fields.pop("round"), fields.pop("leaf")), **fields)


def test_with_a_lossless_codec_the_root_gets_the_flat_weighted_mean() -> None:
    """FedAvg over a two-tier tree (three leaves of different sizes) is FedAvg over all devices."""
    g = torch.Generator().manual_seed(0)
    leaves = {name: [(torch.randn(NUMEL, generator=g), float(w)) for w in weights]
              for name, weights in (("a", [3, 5]), ("b", [10]), ("c", [1, 2, 4, 8]))}
    codec = make_codec("fp32")
    inbox = RootInbox(1, codec, NUMEL, SEED)
    for name, updates in leaves.items():
        sent = LeafUplink(codec, NUMEL, SEED, name).encode(_leaf_partial(updates), 1)
        assert inbox.take(_through_the_wire(sent, "fp32"))
    flat = _leaf_partial([u for updates in leaves.values() for u in updates])
    assert inbox.merged.count == flat.count == 7 and inbox.merged.weight == flat.weight
    torch.testing.assert_close(inbox.merged.mean(), flat.mean(), rtol=0, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=2**31), st.sampled_from(["qsgd:bits=2", "topk:ratio=0.05", "sign"]))
def test_what_a_leaf_sent_plus_its_residual_is_what_it_had_to_send(seed: int, spec: str) -> None:
    """Error feedback at the leaf (DoubleSqueeze's server): after T rounds, the sum of the decoded
    means plus the residual equals the sum of the true means: nothing the codec dropped is lost."""
    g = torch.Generator().manual_seed(seed)
    codec = make_codec(spec)
    uplink = LeafUplink(codec, NUMEL, SEED, "a")
    sent, true = torch.zeros(NUMEL), torch.zeros(NUMEL)
    for number in range(1, 6):
        partial = _leaf_partial([(torch.randn(NUMEL, generator=g), 2.0), (torch.randn(NUMEL, generator=g), 1.0)])
        true += partial.mean()
        sent += uplink.encode(partial, number, g).partial(codec, NUMEL, SEED).mean()
    torch.testing.assert_close(sent + uplink.residual, true, rtol=0, atol=1e-4)


def test_the_root_takes_each_leafs_sum_once_and_only_for_its_round() -> None:
    codec = make_codec("fp32")
    uplink = LeafUplink(codec, NUMEL, SEED, "a")
    one = uplink.encode(_leaf_partial([(torch.ones(NUMEL), 1.0)]), 3)
    inbox = RootInbox(3, codec, NUMEL, SEED)
    assert inbox.take(one) and not inbox.take(one)  # a resend after the leaf restarted
    assert not inbox.take(uplink.encode(_leaf_partial([(torch.ones(NUMEL), 1.0)]), 4))  # another round's
    assert inbox.merged.count == 1 and inbox.leaves == {"a"}
    empty = LeafUplink(codec, NUMEL, SEED, "b").encode(Partial.empty(NUMEL, planned=4), 3)
    assert empty.payload == b"" and inbox.take(_through_the_wire(empty, "fp32"))
    assert inbox.merged.count == 1 and inbox.merged.planned == 4


def test_a_leaf_with_nothing_to_send_keeps_its_residual() -> None:
    codec = make_codec("topk:ratio=0.01")
    uplink = LeafUplink(codec, NUMEL, SEED, "a")
    uplink.encode(_leaf_partial([(torch.arange(NUMEL, dtype=torch.float32), 1.0)]), 1)
    kept = uplink.residual.clone()
    assert kept.abs().sum() > 0
    uplink.encode(Partial.empty(NUMEL), 2)
    assert torch.equal(uplink.residual, kept)
    restored = LeafUplink(codec, NUMEL, SEED, "a")
    restored.load_state_dict(uplink.state_dict())
    assert torch.equal(restored.residual, kept)


def _good() -> dict:
    return dict(round=2, leaf="a", codec="qsgd:bits=4", payload=b"x", weight=3.0, count=2, planned=2, noised=False)


@pytest.mark.parametrize("change, reason", [
    ({"round": 3}, "a sum for round 3 in round 2"),
    ({"codec": "fp32"}, "the root asked for 'qsgd:bits=4'"),
    ({"weight": float("nan")}, "weight must be a finite number"),
    ({"weight": -1.0}, "weight must be a finite number"),
    ({"count": -2}, "count must be a whole number"),
    ({"leaf": ""}, "leaf must name the leaf"),
    ({"payload": b""}, "without a payload"),
    ({"weight": 0.0}, "with a payload"),
    ({"count": 0}, "over 0 updates"),
])
def test_a_malformed_leaf_sum_is_refused_with_the_field_and_why(change: dict, reason: str) -> None:
    values = {**_good(), **change}
    content = leaf_sum_record(**values)
    with pytest.raises(LeafSumError, match=reason):
        read_leaf_sum(content, round=2, codec="qsgd:bits=4")


def test_a_record_with_a_missing_or_mistyped_field_or_a_bad_payload_is_refused() -> None:
    content = leaf_sum_record(**_good())
    record = dict(content.config_records[LEAF_RECORD])
    del record["noised"]
    content[LEAF_RECORD] = ConfigRecord(record)
    with pytest.raises(LeafSumError, match="lacks 'noised'"):
        read_leaf_sum(content, round=2, codec="qsgd:bits=4")
    content = leaf_sum_record(**_good())
    content[LEAF_RECORD] = ConfigRecord({**dict(content.config_records[LEAF_RECORD]), "weight": 3})
    with pytest.raises(LeafSumError, match="weight must be a finite number"):
        read_leaf_sum(content, round=2, codec="qsgd:bits=4")
    with pytest.raises(LeafSumError, match="has no 'fedge.leaf' record"):
        read_leaf_sum(RecordDict({UPDATE_RECORD: payload_record(b"x")}), round=2, codec="qsgd:bits=4")
    fields = read_leaf_sum(leaf_sum_record(**_good()), round=2, codec="qsgd:bits=4")
    assert fields == {"round": 2, "leaf": "a", "payload": b"x", "weight": 3.0, "count": 2, "planned": 2,
                      "noised": False}
    corrupt = LeafSum(LeafKey(2, "a"), b"not a payload", 3.0, 2)
    with pytest.raises(PayloadError):
        corrupt.partial(make_codec("qsgd:bits=4"), NUMEL, SEED)
