"""One typed vocabulary of failures: the device's refusals, the coordinator's door and /metrics."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedge.protocol.failures import DECLINED, REFUSALS, Failure, FailureKind
from fedge.protocol.refusals import read_refusal, refusal_content
from fedge.protocol.records import ProtocolError

ROOT = Path(__file__).resolve().parents[2]


def test_a_failure_names_a_known_kind_and_writes_its_value() -> None:
    failure = Failure(7, "timeout", "no reply within 5 s")
    assert failure.kind is FailureKind.TIMEOUT
    assert failure.entry() == {"node": 7, "kind": "timeout", "reason": "no reply within 5 s"}
    assert type(failure.entry()["kind"]) is str  # the row holds plain text, as before the enum
    with pytest.raises(ValueError, match="unknown failure kind 'timout'"):
        Failure(7, "timout", "a typo is refused, not counted under a new label")


def test_refusals_round_trip_typed_and_unknown_kinds_are_malformed() -> None:
    for kind in REFUSALS:
        read = read_refusal(refusal_content(kind, "why"))
        assert read is not None and read[0] is kind
    assert {k for k in FailureKind if k.declined} == DECLINED <= REFUSALS
    with pytest.raises(ProtocolError):
        refusal_content(FailureKind.TIMEOUT, "a coordinator's kind is not a device's refusal")


def test_no_failure_kind_is_compared_as_a_string() -> None:
    """Kinds are compared as members; the wording of a literal would drift unnoticed."""
    pattern = re.compile(r"kind *[=!]= *['\"]")
    found = [f"{path.relative_to(ROOT)}:{n}" for folder in ("server", "flower", "protocol")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, found
