"""Secure aggregation's messages on Flower's Message API: the agreement between the two sides.

A round with ``secure-aggregation`` on takes four exchanges instead of one (five with the
consistency check), every one a ``train`` message carrying the ``secagg`` record, the convention of
Flower's own SecAgg+ (``secaggplus_mod``), in Fedge's coordinator and in ``fedge.flower.secure``
alike:

    train + secagg stage=advertise    ->  ad (signed keys), identity (the device's Ed25519 public key)
    train + secagg stage=share        ->  sealed shares for each neighbour (the coordinator routes them)
    train + secagg stage=masked       ->  update: the masked upload (bit-packed ring elements)
    train + secagg stage=consistency  ->  a signature over the survivors (against an equivocating coordinator)
    train + secagg stage=unmask       ->  reveals: one share per neighbour (seed if it survived, else key)

The device answers the stages other than ``masked`` itself, before any training code runs
(:func:`secure_stage` tells them apart); device mods that act on training (eligibility, budgets,
injected faults, slowdowns) leave them alone: a device that joined a round answers its stages.

Every message carries the round's public plan (participants, grid, ring, graph seed) in its
``secagg`` ConfigRecord, so a device rebuilds the same :class:`SecAggPlan` the coordinator uses and
refuses one it is not part of. Node ids travel packed as little-endian uint64 (Flower's integers are
signed 64-bit, node ids are not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType

from fedge.privacy.distributed_dp import SkellamParams
from fedge.privacy.errors import ProtocolError as SecAggProtocolError
from fedge.privacy.errors import SecAggError
from fedge.privacy.keys import RoundContext
from fedge.privacy.plan import SecAggPlan
from fedge.privacy.shared_grid import SharedGrid

__all__ = [
    "SECAGG_RECORD",
    "MASKED_STAGE",
    "plan_record",
    "plan_from_record",
    "pack_ids",
    "unpack_ids",
    "pack_blobs",
    "unpack_blobs",
    "config_bytes",
    "secure_stage",
]

SECAGG_RECORD = "secagg"
#: the stage of the train message that carries the masked update; every other stage is an exchange
MASKED_STAGE = "masked"
_MAX_BLOBS = 1 << 16


def secure_stage(msg: Message) -> str | None:
    """The secure-aggregation exchange ``msg`` asks for (``advertise``, ``share``, ``consistency``,
    ``unmask``), or None for a message that trains (in clear or masked) or evaluates."""
    if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:
        return None
    record = msg.content.config_records.get(SECAGG_RECORD)
    if record is None:
        return None
    stage = str(record.get("stage", ""))
    return None if stage == MASKED_STAGE else stage


def pack_ids(ids: Sequence[int]) -> bytes:
    return np.asarray(list(ids), dtype="<u8").tobytes()


def unpack_ids(data: bytes) -> list[int]:
    data = bytes(data)
    if len(data) % 8:
        raise SecAggProtocolError(f"a node-id list of {len(data)} bytes is not a whole number of uint64")
    return [int(x) for x in np.frombuffer(data, dtype="<u8")]


def pack_blobs(blobs: Mapping[int, bytes]) -> tuple[bytes, list[bytes]]:
    """A mapping node -> bytes as (packed ids, list of blobs) for a ConfigRecord."""
    keys = sorted(blobs)
    return pack_ids(keys), [bytes(blobs[k]) for k in keys]


def unpack_blobs(ids: bytes, blobs: Sequence[bytes]) -> dict[int, bytes]:
    nodes = unpack_ids(ids)
    if len(nodes) != len(blobs) or len(nodes) > _MAX_BLOBS:
        raise SecAggProtocolError(f"{len(nodes)} ids for {len(blobs)} blobs")
    if len(set(nodes)) != len(nodes):
        raise SecAggProtocolError("a node appears twice in a blob list")
    return {node: bytes(blob) for node, blob in zip(nodes, blobs)}


def plan_record(plan: SecAggPlan, stage: str, **extra: object) -> ConfigRecord:
    """The round's public plan and the stage, plus a stage's own fields."""
    return ConfigRecord({
        "stage": stage, "run-id": plan.context.run_id, "round": plan.context.round,
        "participants": pack_ids(plan.participants), "bits": plan.grid.bits, "clip": float(plan.grid.clip),
        "weight-cap": plan.grid.weight_cap, "dimension": plan.dimension, "graph-seed": plan.graph_seed,
        "neighbours": plan.neighbours, "threshold": plan.threshold, "headroom-bits": plan.headroom_bits,
        "model-size": plan.model_size, "support-seed": plan.support_seed, "consistency": plan.consistency,
        "dp-clip": plan.noise.clip if plan.noise else 0.0, "dp-scale": plan.noise.scale if plan.noise else 0.0,
        "dp-variance": plan.noise.local_variance if plan.noise else 0.0,
        **extra,  # type: ignore[dict-item]
    })


def plan_from_record(record: ConfigRecord) -> tuple[SecAggPlan, str]:
    """(the plan, the stage); every field checked (a bad plan raises a ``SecAggError``)."""
    try:
        variance = float(record["dp-variance"])
        noise = SkellamParams(float(record["dp-clip"]), float(record["dp-scale"]), variance,
                              int(record["dimension"])) if variance > 0 else None
        plan = SecAggPlan(
            RoundContext(bytes(record["run-id"]), int(record["round"])),
            tuple(unpack_ids(record["participants"])),
            SharedGrid(int(record["bits"]), float(record["clip"]), int(record["weight-cap"])),
            int(record["dimension"]), graph_seed=int(record["graph-seed"]), neighbours=int(record["neighbours"]),
            threshold=int(record["threshold"]), headroom_bits=int(record["headroom-bits"]),
            model_size=int(record["model-size"]), support_seed=int(record["support-seed"]),
            consistency=bool(record["consistency"]), noise=noise,
        )
        stage = str(record["stage"])
    except SecAggError:
        raise
    except KeyError as error:
        raise SecAggProtocolError(f"the secagg record lacks {error}") from None
    except (TypeError, ValueError) as error:
        raise SecAggProtocolError(f"the secagg record is malformed: {error}") from None
    return plan, stage


def config_bytes(record: ConfigRecord) -> int:
    """Bytes a secagg record carries: its byte strings in full, 8 per number (what a device pays to send it)."""
    total = 0
    for value in record.values():
        if isinstance(value, (bytes, bytearray)):
            total += len(value)
        elif isinstance(value, list):
            total += sum(len(v) if isinstance(v, (bytes, bytearray)) else 8 for v in value)
        elif isinstance(value, str):
            total += len(value.encode())
        else:
            total += 8
    return total
