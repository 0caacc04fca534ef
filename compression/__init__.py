"""Fedge compression: codecs, error feedback and the self-describing wire format.

Pure layer: depends on torch and numpy only (no Flower, no I/O), so the Flower loops in ``server/``
and ``edge_client/`` and the DDP communication hooks of the cloud tier share it.

The package's names are imported on first use (PEP 562): the codecs need torch, and a process that
only reads a spec or an error type (``fedge demo``'s CLI before it starts Flower's processes, the
partitioner's spec parser) should not pay torch's import for ``fedge.compression.errors``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: each public name and the submodule it lives in
_NAMES = {
    "HEADER_SIZE": "wire",
    "Codec": "codec",
    "ErrorFeedback": "error_feedback",
    "PayloadError": "errors",
    "SpecError": "errors",
    "available_codecs": "registry",
    "derive_seed": "seeds",
    "make_codec": "registry",
    "parse_payload": "wire",
    "parse_spec": "spec",
    "relative_error": "error_feedback",
    "register_codec": "registry",
}
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
    "register_codec",
    "relative_error",
]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(import_module(f"fedge.compression.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'fedge.compression' has no attribute {name!r}")
