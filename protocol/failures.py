"""Why a device gave no usable reply: one typed vocabulary for the device, the coordinator and the
daemon's ``/metrics``.

A failure's *kind* is what code acts on (the downlink ships the lattice base on ``needs-base``,
the selection layer does not penalise a device that declined, ``/metrics`` counts by kind); its
*reason* is free text for people. Kinds used to be bare strings in four files and the daemon
classified reasons with regexes; now every producer names a :class:`FailureKind` and every consumer
compares members, so a typo is an ``AttributeError`` at import, not a silently wrong counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["DECLINED", "REFUSALS", "Failure", "FailureKind", "Rejected"]


class FailureKind(str, Enum):
    """Every kind of failure a step can record. A ``str`` subclass: the metrics row and the
    refusal record carry the value, and rows written before the enum read back unchanged."""

    #: no reply within the step's timeout
    TIMEOUT = "timeout"
    #: the device's ClientApp raised (Flower's error reply)
    CLIENT_ERROR = "client-error"
    #: the reply was refused by the coordinator's door (screen, metrics, decoder, a layer)
    INVALID = "invalid"
    #: asynchronous: the update was older than the staleness bound
    STALE = "stale"
    #: a device dropped out of one of secure aggregation's own stages
    SECAGG = "secagg"
    # -- a device's own typed refusals (``fedge.protocol.refusals``) ---------------------------
    #: the device's copy of a model is not the version the message was built for
    OUT_OF_SYNC = "out-of-sync"
    #: the device cannot rebuild the lattice downlink's base model
    NEEDS_BASE = "needs-base"
    #: the message asks for something the device cannot do
    BAD_CONFIG = "bad-config"
    #: the owner's policy does not let the device train now (declined, not failed)
    NOT_ELIGIBLE = "not-eligible"
    #: the device has spent its daily budget (declined, not failed)
    OVER_BUDGET = "over-budget"
    #: beyond one SuperLink: the device already took part in this root round through another leaf
    #: (it moved during the round); declined, so the root counts it once
    COUNTED_ELSEWHERE = "counted-elsewhere"
    #: the message breaks the privacy policy the device's operator pinned (a round without secure
    #: aggregation on a device that requires it): a failure the operator must see, not a decline
    POLICY = "policy"

    def __str__(self) -> str:  # the wire and row value, not ``FailureKind.TIMEOUT``
        return self.value

    @property
    def declined(self) -> bool:
        """A refusal by the device's own policy: counted apart, never held against the device."""
        return self in DECLINED

    @classmethod
    def of(cls, value: object) -> FailureKind:
        """The kind named ``value`` (a member or its text); ``ValueError`` for any other."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown failure kind {value!r}; known: {sorted(k.value for k in cls)}") from None


#: refusals by the device's own policy: declined, not failed (the coordinator counts them apart)
DECLINED = frozenset({FailureKind.NOT_ELIGIBLE, FailureKind.OVER_BUDGET, FailureKind.COUNTED_ELSEWHERE})
#: the kinds a device may name in a refusal reply; a reply naming another is malformed
REFUSALS = frozenset({FailureKind.OUT_OF_SYNC, FailureKind.NEEDS_BASE, FailureKind.BAD_CONFIG,
                      FailureKind.POLICY}) | DECLINED


@dataclass(frozen=True)
class Failure:
    """Why node ``node`` (None: the whole step) gave no usable reply this step."""

    node: int | None
    kind: FailureKind
    reason: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FailureKind.of(self.kind))

    def entry(self) -> dict[str, Any]:
        """The metrics row's ``rejected`` entry."""
        return {"node": self.node, "kind": self.kind.value, "reason": self.reason}


class Rejected(ValueError):
    """A reply a coordinator cannot use, raised inside its door (by the algorithm, a layer, or the
    decoding): the message is the reason recorded, ``kind`` what code acts on (``INVALID``;
    ``STALE`` for an asynchronous update older than the bound, which still applied its message's
    downlink). Both coordinators' doors turn it into a :class:`Failure` of that kind."""

    def __init__(self, reason: str, kind: FailureKind = FailureKind.INVALID) -> None:
        super().__init__(reason)
        self.kind = FailureKind.of(kind)

    @staticmethod
    def failure(node: int | None, err: Exception) -> Failure:
        """The failure ``err`` raised in the door makes: its kind when it is a :class:`Rejected`,
        else ``INVALID`` (a payload or protocol error: the reply did not decode)."""
        return Failure(node, err.kind if isinstance(err, Rejected) else FailureKind.INVALID, str(err))
