"""Fault injection as a Flower mod, so it covers every handler (FedAvg, EASGD, gossip, ...).

A SuperNode started with ``--node-config "... fault='bitflip'"`` corrupts the update of every train
reply it sends, so operators (and the integration tests) can watch the coordinator reject it:
``truncate`` halves the payload, ``bitflip`` flips a bit of its last byte, ``garbage`` zeroes it,
and ``hang`` never answers (the coordinator's round timeout must cope).
"""

from __future__ import annotations

import logging
import time

from flwr.app import Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from protocol import UPDATE_RECORD, payload_record, read_payload

__all__ = ["FAULTS", "corrupt", "fault_injection_mod"]

log = logging.getLogger(__name__)

FAULTS = ("truncate", "bitflip", "garbage", "hang")


def corrupt(payload: bytes, fault: str) -> bytes:
    if fault == "truncate":
        return payload[: len(payload) // 2]
    if fault == "bitflip":
        return payload[:-1] + bytes([payload[-1] ^ 0x10])
    if fault == "garbage":
        return b"\x00" * len(payload)
    raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")


def fault_injection_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    fault = context.node_config.get("fault")
    if not fault or not msg.metadata.message_type.startswith("train"):
        return call_next(msg, context)
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    log.warning("fault injection %r on purpose (node config 'fault')", fault)
    if fault == "hang":  # a device that goes silent mid-round
        time.sleep(24 * 3600)
    reply = call_next(msg, context)
    if reply.has_error() or UPDATE_RECORD not in reply.content.array_records:
        return reply
    content = RecordDict(dict(reply.content.items()))
    content[UPDATE_RECORD] = payload_record(corrupt(read_payload(reply.content, UPDATE_RECORD), str(fault)))
    return Message(content, reply_to=msg)
