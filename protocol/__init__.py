"""Fedge's message protocol, shared by the coordinator and the edge client (see ``records``).

The names of ``records`` are this package's, imported on first use (PEP 562): ``records`` needs
torch, and a command that only parses its arguments, or starts Flower's processes before it builds
anything (``fedge demo`` starts the SuperLink first), should not pay torch's import for importing
a light submodule such as ``fedge.protocol.plugins``.
"""

from __future__ import annotations

from typing import Any

#: ``fedge.protocol.records.__all__``, spelled out so that it needs no import (a test keeps them equal)
__all__ = ["CONFIG_RECORD", "CONTROL_RECORD", "DOWNLINK_BASE_KEY", "DOWNLINK_RECORD", "DOWNLINK_STEPS_KEY",
           "FEDGE_REPLY_RECORDS", "MEASURE_RECORD", "METRICS_RECORD", "MODEL_RECORD", "PAYLOAD_KEY", "PAYLOAD_STYPE",
           "PUBLIC_RECORD", "RAW_RECORD", "RELAY_RECORD", "UPDATE_RECORD", "ProtocolError", "array_bytes", "flat_array", "message_type_for",
           "payload_array", "payload_bytes", "payload_record", "read_flat", "read_flats", "read_payload",
           "read_payloads", "read_state_dict"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fedge.protocol import records

        return getattr(records, name)
    raise AttributeError(f"module 'fedge.protocol' has no attribute {name!r}")
