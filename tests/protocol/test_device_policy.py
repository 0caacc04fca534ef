"""The ``device-policy`` run setting's grammar, and "stricter" key by key."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedge.protocol.device_policy import PolicyError, parse_device_policy, stricter
from fedge.server.settings import RunSettings, SettingsError


def test_the_grammar() -> None:
    assert parse_device_policy("none") == parse_device_policy("") == {}
    assert parse_device_policy("require-secure-aggregation, min-participants=5,dp-min-noise=0.8") == {
        "require-secure-aggregation": True, "min-participants": 5.0, "dp-min-noise": 0.8}


@pytest.mark.parametrize("spec", ["min-participants", "min-participants=2.5", "min-threshold=1.5", "dp-min-noise=-1",
                                  "dp-min-noise=nan", "loose=1", "min-participants=3,min-participants=4",
                                  "require-secure-aggregation=false"])
def test_a_malformed_policy_is_refused_by_name(spec: str) -> None:
    with pytest.raises(PolicyError, match="device-policy"):
        parse_device_policy(spec)
    with pytest.raises(SettingsError, match="device-policy"):
        RunSettings(device_policy=spec)


@given(st.floats(0, 100), st.floats(0, 100))
def test_stricter_is_the_larger_floor_and_the_smaller_ceiling(own: float, run: float) -> None:
    for key in ("min-participants", "min-threshold", "dp-min-noise"):
        assert stricter(key, own, run) == max(own, run)
    ceiling = stricter("dp-max-clip", own, run)
    if own and run:
        assert ceiling == min(own, run)
    else:  # 0 is "no requirement": the other one holds
        assert ceiling == (own or run)
