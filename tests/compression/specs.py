"""One list of codec specs that every compression test runs over (new codecs join here)."""

QUANTIZERS = [
    "none", "fp16", "bf16",
    "qsgd:bits=2", "qsgd:bits=3,bucket=7", "qsgd:bits=4,bucket=512,norm=l2", "qsgd:bits=4,norm=max",
    "qsgd:bits=8,bucket=64",
    "terngrad:bucket=64", "terngrad:bucket=100,clip=0",
    "onebit:bucket=64", "sign:bucket=64",
    "grid:bits=3,clip=0.5,bucket=100",
]
SPARSIFIERS = [
    "topk:ratio=0.05", "topk:ratio=0.05,sample=0.2", "topk:ratio=0.02+qsgd:bits=4,bucket=16",
    "threshold:value=1.5", "threshold:value=0.5+fp16",
    "randk:ratio=0.1", "randk:ratio=0.1,unbiased=true", "randk:ratio=0.1,seed=5+qsgd:bits=8",
    "dgc:ratio=0.05,sample=0+qsgd:bits=4,bucket=32", "tcs:extra=0.05,sample=0+qsgd:bits=4,bucket=32",
]
ENTROPY = ["zstd:level=3+qsgd:bits=4,bucket=64", "zstd:level=1+topk:ratio=0.05+qsgd:bits=4,bucket=16"]
ALL = QUANTIZERS + SPARSIFIERS + ENTROPY

# Per-tensor policies need the model's tensor sizes; these tests bind them to a 1,000-element model.
LAYERWISE = ["layerwise:min=100,small=fp16+qsgd:bits=4,bucket=64"]
SIZES = (50, 300, 20, 630)


def make(spec: str):  # type: ignore[no-untyped-def]
    from fedge.compression import make_codec

    return make_codec(spec).for_model(SIZES)
