"""The one downlink layer: when it publishes a version, and whose copy a failure forgets."""

from __future__ import annotations

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType, RecordDict

from fedge.coordinator.downlink_layer import DownlinkLayer
from fedge.protocol.failures import Failure, FailureKind
from fedge.protocol.records import DOWNLINK_RECORD
from fedge.coordinator.step import Outgoing, Reply, Step

SIZES = [40, 24]


def _layer() -> DownlinkLayer:
    layer = DownlinkLayer("lattice:ratio=0.25")  # as the engine's adapter makes it: a base every node builds
    layer.begin(torch.linspace(-1, 1, sum(SIZES)), SIZES, seeded=True)
    return layer


def _send(layer: DownlinkLayer, step: Step, model: torch.Tensor, nodes: list[int],
          kind: str = MessageType.TRAIN) -> dict[int, str]:
    """What kind of lattice message each node got."""
    outgoing = [Outgoing(n, RecordDict({"config": ConfigRecord()}), kind, model=model) for n in nodes]
    layer.outgoing(step, outgoing)
    assert all(DOWNLINK_RECORD in o.content for o in outgoing)
    return {o.node: _kind(o) for o in outgoing}


def _kind(o: Outgoing) -> str:
    from fedge.compression.lattice import SNAPSHOT, lattice_header
    from fedge.protocol.records import PAYLOAD_KEY, payload_bytes

    payload = payload_bytes(o.content[DOWNLINK_RECORD][PAYLOAD_KEY], "payload")
    kind, _, _ = lattice_header(payload)
    return "snapshot" if kind == SNAPSHOT else "change"


def _reply(layer: DownlinkLayer, step: Step, node: int) -> None:
    layer.arrived(step, Reply(node, RecordDict()))


def test_a_reply_that_arrived_keeps_its_copy_a_lost_or_failed_one_gets_a_snapshot() -> None:
    """Node 1 answers; node 2's update arrives but does not decode (it did apply its message); node 3
    errs; node 4 never answers. Next step: 1 and 2 get a change, 3 and 4 a snapshot."""
    layer, model = _layer(), torch.linspace(-1, 1, sum(SIZES)) + 0.3
    step = Step(1, [1, 2, 3, 4])
    assert set(_send(layer, step, model, [1, 2, 3, 4]).values()) == {"snapshot"}
    for node in (1, 2):
        _reply(layer, step, node)
    layer.arrived(step, Failure(2, FailureKind.INVALID, "payload checksum mismatch"))
    layer.arrived(step, Failure(3, FailureKind.CLIENT_ERROR, "the client raised"))
    step = Step(2, [1, 2, 3, 4])
    assert _send(layer, step, model + 0.2, [1, 2, 3, 4]) == {1: "change", 2: "change", 3: "snapshot",
                                                              4: "snapshot"}


def test_a_step_publishes_once_and_only_what_moved_or_what_the_copy_still_owes() -> None:
    layer, model = _layer(), torch.linspace(-1, 1, sum(SIZES)) + 0.3
    step = Step(1, [1, 2])
    _send(layer, step, model, [1])
    _send(layer, step, model + 5.0, [2])  # the same step: no second version, even with another model
    assert layer.broadcast is not None and layer.broadcast.version == 1
    _send(layer, Step(1), model, [1], kind=MessageType.EVALUATE)  # an evaluate step, same model: nothing new
    assert layer.broadcast.version == 1
    _send(layer, Step(2), model, [1])  # a train step, same model, but the copy still lags it: a version
    assert layer.broadcast.version == 2
    for number in range(3, 30):  # until the copy is within half a lattice step of the model
        if not layer.broadcast.owes(model):
            break
        _send(layer, Step(number), model, [1])
    version = layer.broadcast.version
    _send(layer, Step(99), model, [1])
    assert layer.broadcast.version == version and not layer.broadcast.owes(model)


def test_a_flower_apps_downlink_builds_its_zero_base_from_the_first_model_and_ships_raw_arrays() -> None:
    import numpy as np

    from fedge.protocol.config_keys import LAYOUT_KEY, LAYOUT_SPEC_KEY
    from fedge.protocol.layout import Layout
    from fedge.protocol.records import RAW_RECORD

    arrays = ArrayRecord({"w": Array(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)),
                          "count": Array(np.array([7], dtype=np.int64))})
    layout = Layout(arrays)
    layer = DownlinkLayer.for_app("lattice:ratio=0.5")
    o = Outgoing(5, RecordDict({"arrays": arrays, "config": ConfigRecord()}), MessageType.TRAIN,
                 model=torch.from_numpy(layout.flatten(arrays)))
    layer.outgoing(Step(1), [o])
    assert layer.broadcast is not None and not layer.broadcast.base.any()  # a zero base every node builds
    assert "arrays" not in o.content and RAW_RECORD in o.content and list(o.content[RAW_RECORD]) == ["count"]
    config = o.content.config_records["config"]
    assert config[LAYOUT_KEY] == layout.digest and config[LAYOUT_SPEC_KEY] == layout.spec
    assert layer.bytes > 0


def test_a_copy_that_cannot_follow_the_model_is_reported_once_with_the_knobs(caplog) -> None:
    """A 4-bit lattice moves a coordinate at most 7 steps a version: a model that runs away from its
    start leaves the devices' copy behind; the step's metrics show the lag and the run is warned once."""
    import logging

    from fedge.coordinator.downlink_layer import LAG_VERSIONS, _StepTally

    layer = DownlinkLayer("lattice:ratio=0.05,bits=4")
    base = torch.linspace(-1, 1, sum(SIZES))
    layer.begin(base, SIZES, seeded=True)
    caplog.set_level(logging.WARNING, logger="fedge.coordinator.downlink_layer")
    for number in range(1, 3 * LAG_VERSIONS):
        _send(layer, Step(number, [1]), base + 5.0 * number, [1])
    metrics = layer.metrics(_StepTally())
    assert metrics["downlink_lag"] > 0.9 and metrics["downlink_clamped"] > 0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "raise ratio or bits" in warnings[0]

    healthy = _layer()
    caplog.clear()
    for number in range(1, 3 * LAG_VERSIONS):
        _send(healthy, Step(number, [1]), base + 0.01 * number, [1])
    assert healthy.metrics(_StepTally())["downlink_lag"] < 0.9 and not caplog.records
