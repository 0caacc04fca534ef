"""A device's refusal, typed: what a device says when it will not (or cannot) do what a message asks.

A handler that raises one of these does not fail with Flower's generic error text: the ClientApp's
``refusal_mod`` (``fedge.edge_client.refusals``) turns it into a reply holding only a ``refusal``
ConfigRecord, ``{kind, reason}``, and the coordinator counts it by ``kind`` and acts on the kind,
never on the wording (the downlink forgets a device's copy on ``out-of-sync`` and ships the
lattice base on ``needs-base``). Anything else a handler raises still travels as Flower's error.
"""

from __future__ import annotations

from typing import ClassVar

from flwr.app import ConfigRecord, RecordDict

from fedge.protocol.failures import DECLINED, REFUSALS, FailureKind
from fedge.protocol.records import ProtocolError
from fedge.protocol.resources import RESOURCES_RECORD

__all__ = [
    "DECLINED",
    "REFUSAL_RECORD",
    "BadConfigRefusal",
    "CountedElsewhereRefusal",
    "DeviceRefusal",
    "MissingBaseError",
    "NotEligibleRefusal",
    "OutOfSyncError",
    "OverBudgetRefusal",
    "PolicyRefusal",
    "read_refusal",
    "refusal_content",
]

#: the record a refusal reply carries, alone
REFUSAL_RECORD = "refusal"

_MAX_REASON = 500


class DeviceRefusal(RuntimeError):
    """Base of the refusals a device reports as a typed record; ``kind`` is one of the refusal kinds
    of ``fedge.protocol.failures`` (``REFUSALS``)."""

    kind: ClassVar[FailureKind] = FailureKind.BAD_CONFIG


class OutOfSyncError(DeviceRefusal):
    """The coordinator sent a change for a version of a copy that this node does not hold."""

    kind = FailureKind.OUT_OF_SYNC


class MissingBaseError(OutOfSyncError):
    """This device's seeded initial model differs from the coordinator's lattice base."""

    kind = FailureKind.NEEDS_BASE


class NotEligibleRefusal(DeviceRefusal):
    """The device's owner does not let it train under the present conditions."""

    kind = FailureKind.NOT_ELIGIBLE


class OverBudgetRefusal(DeviceRefusal):
    """The device has spent today's budget of rounds or megabytes."""

    kind = FailureKind.OVER_BUDGET


class CountedElsewhereRefusal(DeviceRefusal):
    """The device took part in this root round through another leaf (it moved during the round)."""

    kind = FailureKind.COUNTED_ELSEWHERE


class PolicyRefusal(DeviceRefusal):
    """The message breaks the device's own privacy policy (``fedge.edge_client.privacy_policy``)."""

    kind = FailureKind.POLICY


class BadConfigRefusal(DeviceRefusal):
    """The message asks for something this device cannot do."""

    kind = FailureKind.BAD_CONFIG


def refusal_content(kind: FailureKind | str, reason: str) -> RecordDict:
    """The content of a refusal reply."""
    if kind not in REFUSALS:
        raise ProtocolError(f"unknown refusal kind {kind!r}; known: {sorted(k.value for k in REFUSALS)}")
    return RecordDict({REFUSAL_RECORD: ConfigRecord({"kind": FailureKind(kind).value,
                                                      "reason": reason[:_MAX_REASON]})})


def read_refusal(content: RecordDict) -> tuple[FailureKind, str] | None:
    """``(kind, reason)`` if ``content`` is a refusal reply, else None; a malformed refusal (another
    record beside it than the resource report, an unknown kind, a reason that is not text) raises :class:`ProtocolError`."""
    if REFUSAL_RECORD not in content:
        return None
    if set(content) - {REFUSAL_RECORD, RESOURCES_RECORD} or REFUSAL_RECORD not in content.config_records:
        raise ProtocolError(f"a refusal reply carries only its {REFUSAL_RECORD!r} ConfigRecord "
                            f"(and the device's {RESOURCES_RECORD!r} report)")
    record = content.config_records[REFUSAL_RECORD]
    kind, reason = record.get("kind"), record.get("reason")
    if kind not in REFUSALS or set(record) != {"kind", "reason"}:
        raise ProtocolError(f"malformed refusal: kind {kind!r}, keys {sorted(record)[:5]}")
    if not isinstance(reason, str):
        raise ProtocolError("malformed refusal: its reason is not text")
    return FailureKind(kind), reason[:_MAX_REASON]
