"""The Fedge message protocol: record names, message types and payload records, for both sides.

The coordinator (``server/``) and the edge client (``edge_client/``) must not import each other, yet
they must agree on every name and on how an encoded payload rides inside a Flower record, the way
they agree on the wire format of ``compression/``. This module is that agreement. It builds and
reads records and validates what it reads as strictly on the device as on the coordinator: a
payload array of the wrong type or size, a model record with missing, extra, misshapen or
non-finite tensors, each raise :class:`ProtocolError` (a ``ValueError``) with the reason.

Messages (``record name: what``), one vocabulary for Fedge's engine and ``fedge.flower`` in a
user's Flower app (the records that ride beside a user's own are namespaced ``fedge.``)::

    server -> client   config          ConfigRecord: round, task, codec, hyper-parameters (round_config);
                                       its Fedge keys: config_keys.py
                       arrays          ArrayRecord: a full model (state dict)
                       fedge.downlink  ArrayRecord{payload[, steps][, base]}: lattice change or snapshot of
                                       the node's versioned copy of the model (FedAvg, FedBuff, EASGD's
                                       center; a Flower app's strategies)
                       fedge.raw       ArrayRecord: a Flower app's integer buffers, as they are
                       relay           ArrayRecord{<node id>: payload}: neighbours' encoded copy updates (gossip)
                       public          ArrayRecord{<node id>: float32 vector}: full public copies (gossip resync)
    client -> server   fedge.update    ArrayRecord{payload}: the encoded (or masked) update, the counted uplink
                       fedge.raw       ArrayRecord: a Flower app's integer buffers, as trained
                       metrics         MetricRecord: num-examples, train-loss, payload-bytes, ...
                       measure         ArrayRecord{model: float32 vector}: exact local model, measurement only
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MessageType, RecordDict

__all__ = [
    "CONFIG_RECORD",
    "CONTROL_RECORD",
    "DOWNLINK_BASE_KEY",
    "DOWNLINK_RECORD",
    "DOWNLINK_STEPS_KEY",
    "FEDGE_REPLY_RECORDS",
    "MEASURE_RECORD",
    "METRICS_RECORD",
    "MODEL_RECORD",
    "PAYLOAD_KEY",
    "PAYLOAD_STYPE",
    "PUBLIC_RECORD",
    "RAW_RECORD",
    "RELAY_RECORD",
    "UPDATE_RECORD",
    "ProtocolError",
    "array_bytes",
    "flat_array",
    "message_type_for",
    "payload_array",
    "payload_bytes",
    "payload_record",
    "read_flat",
    "read_flats",
    "read_payload",
    "read_payloads",
    "read_state_dict",
]

MODEL_RECORD = "arrays"
DOWNLINK_RECORD = "fedge.downlink"
CONFIG_RECORD = "config"
UPDATE_RECORD = "fedge.update"
#: a Flower app's messages (``fedge.flower``): the arrays that are not floating point (integer
#: buffers), sent as they are beside a payload or a lattice message
RAW_RECORD = "fedge.raw"
METRICS_RECORD = "metrics"
MEASURE_RECORD = "measure"
RELAY_RECORD = "relay"
PUBLIC_RECORD = "public"
PAYLOAD_KEY = "payload"
#: SCAFFOLD: the server's control variate going down and a device's control change going up, each one
#: payload (``PAYLOAD_KEY``) encoded with the codec the message's config names
CONTROL_RECORD = "fedge.control"
#: a Flower app's reply records that are Fedge's, not the model's arrays (what a strategy never sees)
FEDGE_REPLY_RECORDS = (UPDATE_RECORD, RAW_RECORD, CONTROL_RECORD)
#: the lattice downlink's record (``downlink``) carries, besides its payload, the per-tensor steps
#: (snapshots) and the base model (only for a device that cannot rebuild it)
DOWNLINK_STEPS_KEY = "steps"
DOWNLINK_BASE_KEY = "base"
#: stype of a raw-bytes uint8 Array: Flower adds no .npy header, so its size is the payload's size.
PAYLOAD_STYPE = "fedge.payload/1"
#: stype of a flat float32 vector (public copies, measured models), raw little-endian bytes.
FLAT_STYPE = "fedge.flat-f32/1"

#: The largest payload either side accepts in one array (far above any model Fedge trains here; a
#: forged size must cost an error, not an allocation).
MAX_PAYLOAD_BYTES = 1 << 31


class ProtocolError(ValueError):
    """A record is missing, of the wrong kind, or holds values outside what the protocol allows."""


def message_type_for(algorithm: str) -> str:
    """Flower message type of an algorithm's train message: FedAvg keeps the plain ``train`` (so a
    generic Flower client understands it); the others use Flower's named actions, ``train.gossip``
    reaching the handler registered with ``@app.train("gossip")``."""
    return MessageType.TRAIN if algorithm == "fedavg" else f"{MessageType.TRAIN}.{algorithm}"


def payload_record(payload: bytes | bytearray | memoryview, key: str = PAYLOAD_KEY) -> ArrayRecord:
    """An ArrayRecord carrying ``payload`` as one raw uint8 array (Flower chunks and streams it)."""
    return ArrayRecord({key: payload_array(payload)})


def payload_array(payload: bytes | bytearray | memoryview) -> Array:
    """One encoded payload as a raw uint8 Array (a relay record holds one per node)."""
    data = bytes(payload)
    return Array(dtype="uint8", shape=(len(data),), stype=PAYLOAD_STYPE, data=data)


def payload_bytes(array: Array, where: str) -> bytes:
    """The bytes of one payload array (``where`` names it in the error), checked."""
    if not isinstance(array, Array):
        raise ProtocolError(f"{where} is not an Array")
    if array.stype != PAYLOAD_STYPE or array.dtype != "uint8":
        raise ProtocolError(f"{where} has stype {array.stype!r} dtype {array.dtype!r}, expected a {PAYLOAD_STYPE} "
                            "uint8 array")
    data = array.data
    if list(array.shape) != [len(data)] or len(data) > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"{where} declares shape {list(array.shape)} for {len(data)} bytes")
    return data


def read_payload(content: RecordDict, record: str, key: str = PAYLOAD_KEY) -> bytes:
    """The payload bytes at ``content[record][key]``, checked (the codec then checks the bytes)."""
    if record not in content.array_records:
        raise ProtocolError(f"message has no {record!r} ArrayRecord")
    arrays = content.array_records[record]
    if key not in arrays:
        raise ProtocolError(f"{record!r} record has no {key!r} array")
    return payload_bytes(arrays[key], f"{record}[{key}]")


def read_payloads(content: RecordDict, record: str) -> dict[str, bytes]:
    """Every payload array of ``content[record]`` (a relay record: one payload per node id)."""
    if record not in content.array_records:
        return {}
    return {key: payload_bytes(array, f"{record}[{key}]")
            for key, array in content.array_records[record].items()}


def flat_array(vector: torch.Tensor) -> Array:
    """A flat float32 vector as raw bytes (no .npy header: what is counted is what is sent)."""
    data = vector.detach().reshape(-1).to(torch.float32).contiguous().numpy().tobytes()
    return Array(dtype="float32", shape=(len(data) // 4,), stype=FLAT_STYPE, data=data)


def read_flat(array: Array, numel: int, where: str) -> torch.Tensor:
    """A flat float32 vector of exactly ``numel`` finite elements."""
    if not isinstance(array, Array) or array.stype != FLAT_STYPE or array.dtype != "float32":
        raise ProtocolError(f"{where} is not a {FLAT_STYPE} float32 array")
    if list(array.shape) != [numel] or len(array.data) != 4 * numel:
        raise ProtocolError(f"{where} has shape {list(array.shape)} ({len(array.data)} bytes), expected [{numel}]")
    vector = torch.from_numpy(np.frombuffer(array.data, dtype="<f4").copy())
    if not bool(torch.isfinite(vector).all()):
        raise ProtocolError(f"{where} holds NaN or infinite values")
    return vector


def read_flats(content: RecordDict, record: str, numel: int) -> dict[str, torch.Tensor]:
    if record not in content.array_records:
        return {}
    return {key: read_flat(array, numel, f"{record}[{key}]") for key, array in content.array_records[record].items()}


def read_state_dict(
    content: RecordDict, record: str, template: Mapping[str, torch.Tensor]
) -> OrderedDict[str, torch.Tensor]:
    """A model state dict with exactly ``template``'s keys, shapes and dtypes, all values finite."""
    if record not in content.array_records:
        raise ProtocolError(f"message has no {record!r} ArrayRecord")
    arrays = content.array_records[record]
    if set(arrays.keys()) != set(template.keys()):
        missing = sorted(set(template) - set(arrays.keys()))
        extra = sorted(set(arrays.keys()) - set(template))
        raise ProtocolError(f"{record!r} record does not match the model (missing {missing}, unexpected {extra})")
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, like in template.items():
        array = arrays[key]
        if tuple(array.shape) != tuple(like.shape) or array.dtype != str(like.dtype).removeprefix("torch."):
            raise ProtocolError(
                f"{record}[{key}] is {array.dtype}{list(array.shape)}, the model needs "
                f"{str(like.dtype).removeprefix('torch.')}{list(like.shape)}"
            )
        try:
            tensor = torch.from_numpy(np.array(array.numpy(), copy=True))
        except Exception as err:  # a malformed .npy body: numpy raises several exception types
            raise ProtocolError(f"{record}[{key}] cannot be read: {err}") from None
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ProtocolError(f"{record}[{key}] holds NaN or infinite values")
        out[key] = tensor
    return out


def array_bytes(content: RecordDict, records: tuple[str, ...] | None = None) -> int:
    """Bytes of the arrays a message carries (all ArrayRecords, or only ``records``): what Flower
    serializes for them, .npy headers included where the array has one."""
    return sum(
        len(array.data)
        for name, record in content.array_records.items()
        if records is None or name in records
        for array in record.values()
    )
