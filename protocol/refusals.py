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
    "BAD_CONFIG",
    "COUNTED_ELSEWHERE",
    "DECLINED",
    "KINDS",
    "NEEDS_BASE",
    "NOT_ELIGIBLE",
    "OUT_OF_SYNC",
    "OVER_BUDGET",
    "POLICY",
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

#: the kinds, from the one vocabulary of failures (``fedge.protocol.failures``)
OUT_OF_SYNC = FailureKind.OUT_OF_SYNC
NEEDS_BASE = FailureKind.NEEDS_BASE
BAD_CONFIG = FailureKind.BAD_CONFIG
NOT_ELIGIBLE = FailureKind.NOT_ELIGIBLE
OVER_BUDGET = FailureKind.OVER_BUDGET
COUNTED_ELSEWHERE = FailureKind.COUNTED_ELSEWHERE
POLICY = FailureKind.POLICY
#: every kind a coordinator accepts in a refusal; a reply naming another is rejected as malformed
KINDS = REFUSALS

_MAX_REASON = 500


class DeviceRefusal(RuntimeError):
    """Base of the refusals a device reports as a typed record; ``kind`` is one of :data:`KINDS`."""

    kind: ClassVar[FailureKind] = BAD_CONFIG


class OutOfSyncError(DeviceRefusal):
    """The coordinator sent a change for a version of a copy that this node does not hold."""

    kind = OUT_OF_SYNC


class MissingBaseError(OutOfSyncError):
    """This device's seeded initial model differs from the coordinator's lattice base."""

    kind = NEEDS_BASE


class NotEligibleRefusal(DeviceRefusal):
    """The device's owner does not let it train under the present conditions."""

    kind = NOT_ELIGIBLE


class OverBudgetRefusal(DeviceRefusal):
    """The device has spent today's budget of rounds or megabytes."""

    kind = OVER_BUDGET


class CountedElsewhereRefusal(DeviceRefusal):
    """The device took part in this root round through another leaf (it moved during the round)."""

    kind = COUNTED_ELSEWHERE


class PolicyRefusal(DeviceRefusal):
    """The message breaks the device's own privacy policy (``fedge.edge_client.privacy_policy``)."""

    kind = POLICY


class BadConfigRefusal(DeviceRefusal):
    """The message asks for something this device cannot do."""

    kind = BAD_CONFIG


def refusal_content(kind: FailureKind | str, reason: str) -> RecordDict:
    """The content of a refusal reply."""
    if kind not in KINDS:
        raise ProtocolError(f"unknown refusal kind {kind!r}; known: {sorted(k.value for k in KINDS)}")
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
    if kind not in KINDS or set(record) != {"kind", "reason"}:
        raise ProtocolError(f"malformed refusal: kind {kind!r}, keys {sorted(record)[:5]}")
    if not isinstance(reason, str):
        raise ProtocolError("malformed refusal: its reason is not text")
    return FailureKind(kind), reason[:_MAX_REASON]
