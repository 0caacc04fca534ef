"""Fault injection as a Flower mod, so it covers every handler (FedAvg, EASGD, gossip, ...).

A SuperNode started with ``--node-config "... fault='bitflip'"`` (or, in a simulation, one of the
last partitions under the run setting ``faulty-clients = "fraction=0.2,fault=bitflip"``) corrupts the
update of every train reply it sends, so operators (and the integration tests) can watch the coordinator reject it:
``truncate`` halves the payload, ``bitflip`` flips a bit of its last byte, ``garbage`` zeroes it,
``hang`` never answers (the coordinator's round timeout must cope), and ``crash`` fails at once
(a device gone mid-round, without tying up a simulation worker for the timeout).

Two Byzantine faults send *well-formed* hostile replies, which no decoder can catch, to exercise
the robust aggregators, the norm bound and the weight cap: ``signflip`` re-encodes the update
negated and scaled by 10 with the round's own codec, ``inflate`` claims 10^9 training examples.
"""

from __future__ import annotations

import logging
import time

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fedge.protocol import METRICS_RECORD, UPDATE_RECORD, payload_record, read_payload
from fedge.protocol.faulty_clients import FAULTS, faulty_partition, parse_faulty_clients
from fedge.protocol.secagg import secure_stage

__all__ = ["FAULTS", "corrupt", "fault_injection_mod", "fault_of"]

log = logging.getLogger(__name__)

BYZANTINE_SCALE = -10.0
INFLATED_EXAMPLES = 10**9


def corrupt(payload: bytes, fault: str) -> bytes:
    if fault == "truncate":
        return payload[: len(payload) // 2]
    if fault == "bitflip":
        return payload[:-1] + bytes([payload[-1] ^ 0x10])
    if fault == "garbage":
        return b"\x00" * len(payload)
    raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")


def fault_of(context: Context) -> str:
    """This node's fault ('' for none): its own node config first, else the run's faulty-clients."""
    own = context.node_config.get("fault")
    if own:
        return str(own)
    fraction, fault = parse_faulty_clients(str(context.run_config.get("faulty-clients", "none")))
    partition, partitions = context.node_config.get("partition-id"), context.node_config.get("num-partitions")
    if not fault or partition is None or partitions is None:
        return ""
    return fault if faulty_partition(int(partition), int(partitions), fraction) else ""


def fault_injection_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    fault = fault_of(context)
    if not fault or not msg.metadata.message_type.startswith("train") or secure_stage(msg):
        return call_next(msg, context)
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    log.warning("fault injection %r on purpose (node config 'fault' or run setting 'faulty-clients')", fault)
    if fault == "hang":  # a device that goes silent mid-round
        time.sleep(24 * 3600)
    if fault == "crash":  # a device that vanishes mid-round, answering nothing useful
        raise RuntimeError("fault injection: the device crashed while training")
    reply = call_next(msg, context)
    if reply.has_error() or UPDATE_RECORD not in reply.content.array_records:
        return reply
    content = RecordDict(dict(reply.content.items()))
    payload = read_payload(reply.content, UPDATE_RECORD)
    if fault == "signflip":
        content[UPDATE_RECORD] = payload_record(_signflip(msg, payload))
    elif fault == "inflate":
        metrics = MetricRecord(dict(reply.content.metric_records[METRICS_RECORD]))
        metrics["num-examples"] = INFLATED_EXAMPLES
        content[METRICS_RECORD] = metrics
    else:
        content[UPDATE_RECORD] = payload_record(corrupt(payload, str(fault)))
    return Message(content, reply_to=msg)


def _signflip(msg: Message, payload: bytes) -> bytes:
    """The update negated and scaled, encoded with the round's codec: it decodes cleanly."""
    from fedge.edge_client import local
    from fedge.tasks import numel_of

    config = local.round_config(msg)
    task = local.task_of(config)
    model = task.build_model()  # once: its layout gives the codec and the size
    codec = local.codec_for(config.codec, task, model).for_round(config.round, config.seed)
    numel = numel_of(model.state_dict())
    return codec.encode(codec.decode(payload, numel) * BYZANTINE_SCALE)
