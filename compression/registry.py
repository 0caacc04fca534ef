"""The codec registry: spec string -> codec object.

Quantizers: ``none`` (fp32), ``fp16``, ``bf16``, ``qsgd:bits=4,bucket=512,norm=max``,
``terngrad:bucket=4096,clip=2.5``, ``onebit:bucket=512``, ``sign:bucket=512``.
Sparsifiers: ``topk:ratio=0.01[,sample=0.01]``, ``threshold:value=1e-3``,
``randk:ratio=0.01[,unbiased=true][,seed=S|,shared=true]``, and Deep Gradient Compression
``dgc:ratio=0.001,momentum=0.9,warmup=4`` (a client memory over sampled top-k); each may be followed by ``+`` and a quantizer for the
kept values, e.g. ``topk:ratio=0.01+qsgd:bits=4``. Per-tensor policy:
``layerwise:min=1024,small=none+qsgd:bits=4`` (small tensors uncompressed; needs ``for_model``).
Lossless entropy stage: ``zstd:level=3+<codec>``. Unspecified parameters take the codec's defaults;
:attr:`Codec.spec` gives the canonical form.
"""

from __future__ import annotations

from collections.abc import Callable

from fedge.compression.codec import Codec
from fedge.compression.dense import BFloat16Codec, Float16Codec, Float32Codec
from fedge.compression.dgc import DGCCodec
from fedge.compression.entropy import ZstdCodec
from fedge.compression.errors import SpecError
from fedge.compression.layerwise import LayerwiseCodec
from fedge.compression.qsgd import QSGDCodec
from fedge.compression.sign import OneBitCodec, ScaledSignCodec
from fedge.compression.sparse import RandomKCodec, ThresholdCodec, TopKCodec
from fedge.compression.spec import build_from_spec, parse_spec
from fedge.compression.terngrad import TernGradCodec

__all__ = ["available_codecs", "make_codec", "register_codec"]

_REGISTRY: dict[str, Callable[..., Codec]] = {}


def register_codec(name: str, factory: Callable[..., Codec]) -> None:
    """Make ``factory`` available under ``name``; its keyword arguments are the spec's keys."""
    _REGISTRY[name] = factory


def available_codecs() -> list[str]:
    return sorted(_REGISTRY)


def make_codec(spec: str) -> Codec:
    """Build the codec a spec string names, with typed and validated parameters."""
    head, plus, tail = spec.partition("+")
    if "values" in parse_spec(head)[1]:
        raise SpecError("give a sparsifier's values codec after '+', e.g. topk:ratio=0.01+qsgd:bits=4")
    extra = {"values": make_codec(tail)} if plus else None
    codec = build_from_spec(head, _REGISTRY, family="codec", extra=extra)
    assert isinstance(codec, Codec)
    return codec


register_codec("none", Float32Codec)
register_codec("fp32", Float32Codec)
register_codec("fp16", Float16Codec)
register_codec("bf16", BFloat16Codec)
register_codec("qsgd", QSGDCodec)
register_codec("terngrad", TernGradCodec)
register_codec("onebit", OneBitCodec)
register_codec("sign", ScaledSignCodec)
register_codec("topk", TopKCodec)
register_codec("threshold", ThresholdCodec)
register_codec("randk", RandomKCodec)
register_codec("dgc", DGCCodec)
register_codec("layerwise", LayerwiseCodec)
register_codec("zstd", ZstdCodec)
