"""The codec registry: spec string -> codec object.

``none`` (fp32), ``fp16``, ``qsgd:bits=4,bucket=512,norm=max``. Unspecified parameters take the codec's
defaults; :attr:`Codec.spec` gives the canonical form with every parameter spelled out.
"""

from __future__ import annotations

from collections.abc import Callable

from compression.codec import Codec
from compression.dense import Float16Codec, Float32Codec
from compression.qsgd import QSGDCodec
from compression.spec import build_from_spec

__all__ = ["available_codecs", "make_codec", "register_codec"]

_REGISTRY: dict[str, Callable[..., Codec]] = {}


def register_codec(name: str, factory: Callable[..., Codec]) -> None:
    """Make ``factory`` available under ``name``; its keyword arguments are the spec's keys."""
    _REGISTRY[name] = factory


def available_codecs() -> list[str]:
    return sorted(_REGISTRY)


def make_codec(spec: str) -> Codec:
    """Build the codec a spec string names, with typed and validated parameters."""
    codec = build_from_spec(spec, _REGISTRY, family="codec")
    assert isinstance(codec, Codec)
    return codec


register_codec("none", Float32Codec)
register_codec("fp32", Float32Codec)
register_codec("fp16", Float16Codec)
register_codec("qsgd", QSGDCodec)
