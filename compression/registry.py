"""The codec registry: spec string -> codec object.

Quantizers: ``none`` (fp32), ``fp16``, ``bf16``, ``qsgd:bits=4,bucket=512,norm=max``,
``terngrad:bucket=4096,clip=2.5``, ``onebit:bucket=512``, ``sign:bucket=512``.
Sparsifiers: ``topk:ratio=0.01[,sample=0.01]``, ``threshold:value=1e-3``,
``randk:ratio=0.01[,unbiased=true][,seed=S|,shared=true]``, and Deep Gradient Compression
``dgc:ratio=0.001,momentum=0.9,warmup=4`` (a client memory over sampled top-k) and time-correlated
``tcs:extra=0.01`` (values on a support both sides share, plus the top coordinates outside it); each may be followed by ``+`` and a quantizer for the
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
from fedge.compression.grid import GridCodec
from fedge.compression.qsgd import QSGDCodec
from fedge.compression.shared_support import SharedSupportCodec
from fedge.compression.sign import OneBitCodec, ScaledSignCodec
from fedge.compression.sparse import RandomKCodec, ThresholdCodec, TopKCodec
from fedge.compression.spec import build_from_spec, parse_spec
from fedge.compression.terngrad import TernGradCodec
from fedge.compression.wire import CODEC_IDS, USER_CODEC_IDS

__all__ = ["CodecIdError", "available_codecs", "make_codec", "register_codec"]

_REGISTRY: dict[str, Callable[..., Codec]] = {}


class CodecIdError(SpecError):
    """A codec's wire id is missing, outside the reserved range, or taken by another codec."""


def register_codec(name: str, factory: Callable[..., Codec], codec_id: int | None = None) -> None:
    """Make ``factory`` available under ``name``; its keyword arguments are the spec's keys.

    A codec outside Fedge gives its wire id, one of :data:`~fedge.compression.wire.USER_CODEC_IDS`
    (200-254): every payload carries it and every decoder refuses an id it does not know, so the
    coordinator and every device must register the same codec under the same id (a plugin module
    does it on import: ``docs/extending.md``). Registering a name or an id that another codec holds
    is refused; registering the same codec again is a no-op."""
    name = name.lower()
    if name in CODEC_IDS and codec_id is None:  # one of Fedge's own codecs, or a repeat
        _REGISTRY[name] = factory
        return
    if codec_id is None:
        raise CodecIdError(f"codec {name!r} needs a wire id: register_codec({name!r}, factory, codec_id=N) with "
                           f"N in {USER_CODEC_IDS.start}..{USER_CODEC_IDS.stop - 1} (reserved for codecs outside Fedge)")
    if codec_id not in USER_CODEC_IDS:
        raise CodecIdError(f"codec {name!r}: wire id {codec_id} is outside the range reserved for codecs outside "
                           f"Fedge ({USER_CODEC_IDS.start}..{USER_CODEC_IDS.stop - 1})")
    holder = next((other for other, taken in CODEC_IDS.items() if taken == codec_id), None)
    if holder is not None and holder != name:
        raise CodecIdError(f"codec {name!r}: wire id {codec_id} is taken by codec {holder!r}; choose another id")
    if name in CODEC_IDS and CODEC_IDS[name] != codec_id:
        raise CodecIdError(f"codec {name!r} is registered with wire id {CODEC_IDS[name]}, not {codec_id}")
    if name in _REGISTRY and _REGISTRY[name] is not factory and holder == name:
        raise CodecIdError(f"codec {name!r} is registered already, by {_REGISTRY[name]!r}")
    CODEC_IDS[name] = codec_id
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


# Fedge's own codecs (their wire ids are in compression.wire.CODEC_IDS; fp32 is none's alias, dgc
# sends top-k payloads)
_REGISTRY.update({
    "none": Float32Codec,
    "fp32": Float32Codec,
    "fp16": Float16Codec,
    "bf16": BFloat16Codec,
    "qsgd": QSGDCodec,
    "terngrad": TernGradCodec,
    "onebit": OneBitCodec,
    "sign": ScaledSignCodec,
    "topk": TopKCodec,
    "threshold": ThresholdCodec,
    "randk": RandomKCodec,
    "dgc": DGCCodec,
    "layerwise": LayerwiseCodec,
    "zstd": ZstdCodec,
    "grid": GridCodec,
    "tcs": SharedSupportCodec,
})
