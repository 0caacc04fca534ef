"""The lattice downlink's config header: what the coordinator's layer writes, both device paths read."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord
from hypothesis import given
from hypothesis import strategies as st

from fedge.protocol.config_keys import DOWNLINK_BASE_DIGEST, DOWNLINK_CODEC, DOWNLINK_DIGEST, DOWNLINK_VERSION
from fedge.protocol.downlink import DownlinkHeader
from fedge.protocol.records import ProtocolError

_UINT63 = st.integers(0, 2**63 - 1)  # a ConfigRecord's integers are signed 64-bit; the digests fit


@given(st.sampled_from(["lattice:ratio=0.1", "lattice"]), st.integers(0, 10**6), _UINT63, _UINT63)
def test_what_the_layer_writes_a_device_reads(codec: str, version: int, digest: int, base: int) -> None:
    config = ConfigRecord({"round": 3})
    DownlinkHeader(codec, version, digest, base).write(config)
    assert DownlinkHeader.read(config) == DownlinkHeader(codec, version, digest, base)
    # a RoundConfig's extra (Fedge's own devices) reads alike
    assert DownlinkHeader.read(dict(config)) == DownlinkHeader(codec, version, digest, base)


def test_a_full_model_has_no_header_and_a_malformed_one_is_refused_by_name() -> None:
    assert DownlinkHeader.read(ConfigRecord()) is None
    assert DownlinkHeader.read(ConfigRecord({DOWNLINK_CODEC: "none"})) is None
    config = ConfigRecord()
    DownlinkHeader("lattice", 2, 7, 9).write(config)
    malformed = ((DOWNLINK_VERSION, -1), (DOWNLINK_DIGEST, "7"), (DOWNLINK_BASE_DIGEST, 1.5),
                 (DOWNLINK_CODEC, 3))
    for key, bad in malformed:
        broken = ConfigRecord(dict(config))
        broken[key] = bad
        with pytest.raises(ProtocolError, match=f"config {key}="):
            DownlinkHeader.read(broken)
    del config[DOWNLINK_DIGEST]
    with pytest.raises(ProtocolError, match=f"lacks '{DOWNLINK_DIGEST}'"):
        DownlinkHeader.read(config)
