"""The uplink request of a Flower app's train message: what the wrappers write, the device reads."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord
from hypothesis import given
from hypothesis import strategies as st

from fedge.protocol.config_keys import CODEC_KEY, LAYOUT_KEY, ROUND_KEY, SEED_KEY
from fedge.protocol.records import ProtocolError
from fedge.protocol.uplink_request import UplinkRequest

_TEXT = st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), min_size=1, max_size=24)


@given(_TEXT, _TEXT, st.integers(0, 2**31), st.integers(0, 2**62))
def test_what_the_wrapper_writes_the_device_reads(codec: str, layout: str, number: int, seed: int) -> None:
    config = ConfigRecord({"lr": 0.1})
    UplinkRequest(codec, layout, number, seed).write(config)
    assert UplinkRequest.read(config) == UplinkRequest(codec, layout, number, seed)
    assert config["lr"] == 0.1  # the user's own keys stay


def test_no_request_is_none_and_a_malformed_one_is_refused_by_name() -> None:
    assert UplinkRequest.read(None) is None and UplinkRequest.read(ConfigRecord({"lr": 0.1})) is None
    config = ConfigRecord()
    UplinkRequest("qsgd:bits=4", "abc", 3, 0).write(config)
    for key, bad in ((ROUND_KEY, -1), (SEED_KEY, 1.5), (CODEC_KEY, 4), (LAYOUT_KEY, "")):
        broken = ConfigRecord(dict(config))
        broken[key] = bad
        with pytest.raises(ProtocolError, match=f"config {key}="):
            UplinkRequest.read(broken)
    del config[SEED_KEY]
    with pytest.raises(ProtocolError, match="lacks 'fedge.seed'"):
        UplinkRequest.read(config)
