"""Fedge compression: codecs, error feedback and the self-describing wire format.

Pure layer: depends on torch and numpy only (no Flower, no I/O), so the Flower loops in ``server/``
and ``edge_client/`` and the DDP communication hooks of the cloud tier share it.
"""

from fedge.compression.codec import Codec
from fedge.compression.error_feedback import ErrorFeedback, relative_error
from fedge.compression.errors import PayloadError, SpecError
from fedge.compression.registry import available_codecs, make_codec, register_codec
from fedge.compression.seeds import derive_seed
from fedge.compression.spec import parse_spec
from fedge.compression.wire import HEADER_SIZE, parse_payload

__all__ = [
    "HEADER_SIZE",
    "Codec",
    "ErrorFeedback",
    "PayloadError",
    "SpecError",
    "available_codecs",
    "derive_seed",
    "make_codec",
    "parse_payload",
    "parse_spec",
    "relative_error",
    "register_codec",
]
