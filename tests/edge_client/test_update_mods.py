"""One device pipeline: Fedge's ClientApp sends its handlers' updates through the mods a Flower app
lists, and a handed-over update is taken once, by the mod that sends it."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict

import fedge.flower
from fedge.edge_client import device_update
from fedge.edge_client.app import app
from fedge.edge_client.compression_mod import compression_mod
from fedge.edge_client.device_update import DeviceUpdate, hand_off, handed
from fedge.edge_client.layers import UPDATE_MODS
from fedge.protocol import CONFIG_RECORD, METRICS_RECORD, UPDATE_RECORD, read_payload
from fedge.protocol.config_keys import DP_CLIP, DP_FITTED
from fedge.protocol.round_config import RoundConfig


def _config(**extra: object) -> RoundConfig:
    return RoundConfig(round=3, task="digits", partitioning="iid", codec="qsgd:bits=4", error_feedback=True,
                       local_epochs=1, batch_size=32, lr=0.1, momentum=0.0, seed=7, extra=dict(extra))


def test_the_engines_client_app_lists_the_update_mods_a_flower_app_imports() -> None:
    mods = list(app._mods)  # type: ignore[attr-defined]
    at = mods.index(UPDATE_MODS[0])
    assert tuple(mods[at:at + len(UPDATE_MODS)]) == UPDATE_MODS
    assert UPDATE_MODS == (fedge.flower.compression_mod, fedge.flower.secure_mod)
    assert mods.index(fedge.flower.elastic_mod) > at  # EASGD's step too, inside them as a Flower app lists it


def _handed(msg: Message, delta: torch.Tensor, generator: torch.Generator) -> Message:
    return hand_off(msg, DeviceUpdate(delta, examples=12, weighted=True, memory="fedavg", generator=generator,
                                      started=0.0, sizes=[delta.numel()], metrics={"train-loss": 0.5}))


def test_compression_mod_encodes_a_handed_update_as_the_engine_encodes_it_clipped_first() -> None:
    """The payload is the round's codec over the clipped delta, continuing the handler's generator,
    through the handler's memory: what ``local.encode`` gives for the same inputs."""
    from fedge.edge_client import local
    from fedge.edge_client.node_store import NodeStore

    config = _config(**{DP_CLIP: 1.0})
    msg = Message(RecordDict({CONFIG_RECORD: config.to_record()}), dst_node_id=5, message_type="train")
    delta = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 10  # norm far above the clip
    context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    reply = compression_mod(msg, context, lambda m, c: _handed(m, delta, torch.Generator().manual_seed(9)))
    expected, _ = local.encode(delta / delta.norm(), config, [300], NodeStore(RecordDict(), "fedavg"),
                               torch.Generator().manual_seed(9))
    assert read_payload(reply.content, UPDATE_RECORD) == expected
    metrics = reply.content.metric_records[METRICS_RECORD]
    assert metrics[DP_FITTED] == 0.0 and metrics["num-examples"] == 12 and metrics["train-loss"] == 0.5
    assert abs(metrics["update-norm"] - 1.0) < 1e-5
    assert "fedge/fedavg/memory" in "".join(context.state.keys())  # the handler's memory, kept in its namespace


def test_a_handed_update_is_taken_once_and_not_kept_after() -> None:
    msg = Message(RecordDict(), dst_node_id=5, message_type="train")
    reply = _handed(msg, torch.ones(4), torch.Generator())
    reply.content["control"] = ArrayRecord()  # a record of the handler's own passes on with the update
    update = handed(reply)
    assert update is not None and torch.equal(update.delta, torch.ones(4)) and "control" in update.others
    assert handed(reply) is None  # taken: a second mod finds nothing to send twice
    skipped = _handed(msg, torch.ones(4), torch.Generator())
    assert len(device_update._HANDED) == 1
    del skipped
    assert len(device_update._HANDED) == 0  # a reply that skipped the mods leaves nothing behind


def test_an_elastic_train_message_reads_the_nodes_data_once(monkeypatch) -> None:
    """EASGD on Fedge's handler: elastic_mod measures the kept model on the held-out part the handler
    already read (the update carries it), not on a second read of the node's data."""
    from fedge.edge_client import local
    from fedge.edge_client.algorithms import fedavg
    from fedge.edge_client.elastic_mod import elastic_mod
    from fedge.protocol import MODEL_RECORD
    from fedge.protocol.config_keys import EASGD_ALPHA, PROX_MU
    from fedge.tasks import make_task

    reads: list[int] = []
    real = local.node_data
    monkeypatch.setattr(local, "node_data", lambda *args: reads.append(1) or real(*args))
    config = RoundConfig(round=1, task="digits", partitioning="iid", codec="none", error_feedback=False,
                         local_epochs=1, batch_size=32, lr=0.1, momentum=0.0, seed=7, holdout=0.2,
                         extra={EASGD_ALPHA: 0.5, PROX_MU: 0.0})
    model = make_task("digits").build_model()
    content = RecordDict({CONFIG_RECORD: config.to_record(), MODEL_RECORD: ArrayRecord(model.state_dict())})
    msg = Message(content, dst_node_id=5, message_type="train")
    context = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 4}, state=RecordDict(),
                      run_config={})
    update = handed(elastic_mod(msg, context, fedavg.train))
    assert update is not None and update.weighted is False
    assert 0.0 <= update.metrics["local-score"] <= 1.0 and update.metrics["center-distance"] > 0
    assert len(reads) == 1
