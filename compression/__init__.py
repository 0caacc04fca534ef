"""Fedge compression: codecs, error feedback and the self-describing wire format.

Pure layer: depends on torch and numpy only (no Flower, no I/O), so the Flower loops in ``server/``
and ``edge_client/`` and the DDP communication hooks of the cloud tier share it.
"""

from compression.codec import Codec
from compression.error_feedback import ErrorFeedback, relative_error
from compression.errors import PayloadError, SpecError
from compression.registry import available_codecs, make_codec, register_codec
from compression.seeds import derive_seed
from compression.spec import parse_spec
from compression.wire import HEADER_SIZE, parse_payload

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
