"""Mangled payloads raise PayloadError, never another exception, never a hang."""

import random
import struct

import numpy as np
import pytest
import torch

from fedge.compression import HEADER_SIZE, PayloadError, make_codec
from fedge.compression.wire import reseal
from tests.compression.specs import ALL, LAYERWISE, make

SPECS = ALL + LAYERWISE
N = 1000
FUZZ_PER_CODEC = 10_000  # mutated payloads per codec in CI
FUZZ_UNDER_LIMIT = 1_000  # per codec again, under an address-space limit


def _payload(spec: str) -> bytes:
    return make(spec).encode(torch.randn(N, generator=torch.Generator().manual_seed(0)))


def _recrc(data: bytes | bytearray) -> bytes:
    """Fix the checksum so that validation must catch the mutation by looking at the fields."""
    return reseal(data)


def _decode(spec: str, data: bytes, numel: int = N) -> None:
    make(spec).decode(data, numel)


@pytest.mark.parametrize("spec", SPECS)
def test_genuine_payload_decodes(spec: str) -> None:
    _decode(spec, _payload(spec))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("cut", [0, 1, 4, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, -1])
def test_truncated(spec: str, cut: int) -> None:
    data = _payload(spec)
    with pytest.raises(PayloadError):
        _decode(spec, data[:cut])


@pytest.mark.parametrize("spec", SPECS)
def test_wrong_magic(spec: str) -> None:
    data = bytearray(_payload(spec))
    data[0:4] = b"NOPE"
    with pytest.raises(PayloadError, match="magic"):
        _decode(spec, _recrc(data))


@pytest.mark.parametrize("spec", SPECS)
def test_appended_bytes(spec: str) -> None:
    with pytest.raises(PayloadError, match="length"):
        _decode(spec, _payload(spec) + b"\x00")


@pytest.mark.parametrize("spec", SPECS)
def test_consistent_but_wrong_length(spec: str) -> None:
    """Body-length field and actual length agree, but do not fit the element count."""
    data = bytearray(_payload(spec)[:-3])
    data[24:32] = struct.pack("<Q", len(data) - HEADER_SIZE)
    with pytest.raises(PayloadError, match="body is|index|varint|length|truncated|overruns|zstd frame"):
        _decode(spec, _recrc(data))


@pytest.mark.parametrize("spec", SPECS)
def test_element_count_mismatch(spec: str) -> None:
    with pytest.raises(PayloadError, match="element count"):
        _decode(spec, _payload(spec), numel=N + 1)


def test_huge_element_count_does_not_allocate() -> None:
    data = bytearray(_payload("none"))
    data[8:16] = struct.pack("<Q", 1 << 62)
    with pytest.raises(PayloadError, match="exceeds"):
        _decode("none", _recrc(data), numel=1 << 62)


def test_checksum_mismatch() -> None:
    data = bytearray(_payload("qsgd:bits=4,bucket=512"))
    data[-1] ^= 0x01
    with pytest.raises(PayloadError, match="checksum"):
        _decode("qsgd:bits=4,bucket=512", bytes(data))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_bad_qsgd_scale(value: float) -> None:
    spec = "qsgd:bits=4,bucket=512"
    data = bytearray(_payload(spec))
    data[HEADER_SIZE : HEADER_SIZE + 4] = struct.pack("<f", value)
    with pytest.raises(PayloadError, match="scale"):
        _decode(spec, _recrc(data))


@pytest.mark.parametrize("spec", ["none", "fp16"])
def test_non_finite_dense_values(spec: str) -> None:
    data = bytearray(_payload(spec))
    width = 4 if spec == "none" else 2
    data[HEADER_SIZE : HEADER_SIZE + width] = b"\xff" * width  # NaN in both formats
    with pytest.raises(PayloadError, match="finite"):
        _decode(spec, _recrc(data))


def test_out_of_range_quantized_code() -> None:
    spec = "qsgd:bits=2,bucket=16,norm=max"  # codes 0..2 valid, 3 is not
    data = bytearray(_payload(spec))
    scales = 4 * (-(-N // 16))
    data[HEADER_SIZE + scales] = 0xFF
    with pytest.raises(PayloadError, match="out of range"):
        _decode(spec, _recrc(data))


@pytest.mark.parametrize(
    "offset,value,match",
    [(4, 9, "version"), (5, 200, "codec id"), (6, 7, "dtype"), (7, 1, "flags"),
     (16, 9, "parameters"), (5, 0, "encoded with codec")],
)
def test_out_of_range_header_fields(offset: int, value: int, match: str) -> None:
    spec = "qsgd:bits=4,bucket=512"
    data = bytearray(_payload(spec))
    data[offset] = value
    with pytest.raises(PayloadError, match=match):
        _decode(spec, _recrc(data))


def test_not_bytes() -> None:
    with pytest.raises(PayloadError):
        make_codec("none").decode("not bytes", 1)  # type: ignore[arg-type]


def fuzz(spec: str, count: int) -> None:
    """Random byte flips, truncations, insertions; with and without a repaired checksum."""
    rng = random.Random(spec)
    genuine = _payload(spec)
    codec = make(spec)
    for i in range(count):
        data = bytearray(genuine)
        kind = rng.randrange(4)
        if kind == 0:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:
            del data[rng.randrange(len(data)) :]
        elif kind == 2:
            pos = rng.randrange(len(data))
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            pos = rng.randrange(HEADER_SIZE)
            data[pos] = rng.randrange(256)
        candidate = _recrc(data) if (i % 2 and len(data) >= HEADER_SIZE) else bytes(data)
        try:
            out = codec.decode(candidate, N)
        except PayloadError:
            continue
        # A mutation may land on a still-valid encoding (e.g. a different quantized level).
        assert out.shape == (N,) and bool(np.isfinite(out.numpy()).all())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", SPECS)
def test_fuzz_mutations_only_raise_payload_error(spec: str) -> None:
    fuzz(spec, FUZZ_PER_CODEC)


@pytest.mark.timeout(300)
def test_fuzzed_decoders_never_allocate_beyond_a_bound() -> None:
    """Every codec's fuzz loop again, in a process whose address space may grow by 512 MB at most.

    A decoder that trusted a forged count or length would try to allocate far more (the declared
    size of these payloads is 4 KB) and fail with MemoryError, which is not a PayloadError.
    """
    script = f"""
import resource, sys, torch
torch.set_num_threads(1)
from tests.compression import test_payload_validation as t
for spec in t.SPECS:  # compile kernels and warm every path before the limit
    t.make(spec).decode(t._payload(spec), t.N)
size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + 512 * 2**20, resource.RLIM_INFINITY))
for spec in t.SPECS:
    t.fuzz(spec, {FUZZ_UNDER_LIMIT})
print("ok")
"""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=280, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
