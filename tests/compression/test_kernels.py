"""The fused numba kernels against the torch reference path: same wire format, same decoded values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedge.compression import PayloadError, bitpack, kernels, make_codec
from fedge.compression.bucketed import BucketedCodec
from tests.compression.specs import ALL as ALL_SPECS

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba is not installed: no fused kernels")

FUSED = ["qsgd:bits=2", "qsgd:bits=3", "qsgd:bits=4", "qsgd:bits=5,bucket=100", "qsgd:bits=8",
         "qsgd:bits=4,norm=l2", "qsgd:bits=4,bucket=7", "terngrad", "terngrad:clip=0,bucket=64",
         "onebit", "onebit:bucket=12", "sign", "sign:bucket=100"]


def _reference_decode(codec: BucketedCodec, payload: bytes, n: int) -> torch.Tensor:
    """The torch path of the base class, bypassing the fused one."""
    return super(BucketedCodec, codec).decode(payload, n)


@pytest.mark.parametrize("spec", FUSED)
@pytest.mark.parametrize("n", [1, 511, 4097])
def test_fused_decode_equals_the_reference_bit_for_bit(spec: str, n: int) -> None:
    codec = make_codec(spec)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    payload = codec.encode(x, torch.Generator().manual_seed(1))
    fused, reference = codec.decode(payload, n), _reference_decode(codec, payload, n)
    assert torch.equal(fused, reference)
    accumulator = torch.ones(n)
    codec.decode_into(payload, accumulator, alpha=0.25)
    assert torch.allclose(accumulator, 1 + 0.25 * reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("spec", ["qsgd:bits=4", "qsgd:bits=3", "terngrad:clip=0", "qsgd:bits=4,norm=l2"])
def test_fused_stochastic_rounding_is_unbiased(spec: str) -> None:
    codec = make_codec(spec)
    x = torch.randn(512, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(2)
    trials = 3000
    mean = sum(codec.decode(codec.encode(x, generator), 512) for _ in range(trials)) / trials
    scale = float(x.abs().max()) if "l2" not in spec else float(x.norm())
    step = scale / max(1, getattr(codec, "levels", 1))
    # per element the rounding error is at most one step, so its mean has std <= step / (2 sqrt(T))
    assert float((mean - x).abs().max()) < 5 * step / (2 * trials**0.5)


@given(st.integers(1, 8), st.integers(0, 300))
def test_pack_and_unpack_match_bitpack(bits: int, n: int) -> None:
    rng = np.random.default_rng(n * 8 + bits)
    codes = rng.integers(0, 1 << bits, n, dtype=np.uint8)
    packed = np.empty(bitpack.packed_size(n, bits), dtype=np.uint8)
    kernels.pack_into(codes, bits, packed)
    assert packed.tobytes() == bitpack.pack(codes, bits)
    np.testing.assert_array_equal(kernels.unpack(packed, n, bits), codes)
    if 8 % bits == 0 and n:
        assert kernels.max_code_of(packed, n, bits) == int(codes.max())


@pytest.mark.parametrize("spec", ["qsgd:bits=4", "terngrad", "sign", "onebit"])
def test_fused_encoders_reject_non_finite_input(spec: str) -> None:
    codec = make_codec(spec)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(2000)
        x[1234] = bad
        with pytest.raises(ValueError, match="NaN or infinite"):
            codec.encode(x)


def test_bad_codes_leave_the_accumulator_untouched() -> None:
    codec = make_codec("qsgd:bits=4")
    payload = bytearray(codec.encode(torch.randn(1000)))
    payload[-1] |= 0xF0  # code 15 is out of range for 4-bit QSGD (0..14)
    from fedge.compression.wire import reseal

    accumulator = torch.full((1000,), 7.0)
    with pytest.raises(PayloadError, match="out of range"):
        codec.decode_into(reseal(payload), accumulator)
    assert torch.equal(accumulator, torch.full((1000,), 7.0))


def test_reference_path_when_kernels_are_off() -> None:
    """FEDGE_KERNELS=off runs the torch path; payloads cross between the two implementations."""
    codec = make_codec("qsgd:bits=4")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    fused_payload = codec.encode(x, torch.Generator().manual_seed(1))
    script = (
        "import sys, torch; from compression import kernels, make_codec; assert not kernels.available(); "
        "c = make_codec('qsgd:bits=4'); p = sys.stdin.buffer.read(); "
        "y = c.decode(p, 3000); q = c.encode(y, torch.Generator().manual_seed(1)); "
        "sys.stdout.buffer.write(y.numpy().tobytes() + q)"
    )
    done = subprocess.run([sys.executable, "-c", script], input=fused_payload, capture_output=True, check=False,
                          env={**os.environ, "FEDGE_KERNELS": "off"}, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    decoded = np.frombuffer(done.stdout[: 4 * 3000], dtype=np.float32)
    np.testing.assert_array_equal(decoded, codec.decode(fused_payload, 3000).numpy())
    torch_payload = done.stdout[4 * 3000 :]
    assert codec.decode(torch_payload, 3000).shape == (3000,)  # the fused decoder reads the torch encoder


def _both_paths(monkeypatch: pytest.MonkeyPatch, fn):  # type: ignore[no-untyped-def]
    """``fn()`` with the fused kernels, then with the torch reference path."""
    fused = fn()
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "available", lambda: False)
        reference = fn()
    return fused, reference


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_every_codec_decodes_identically_on_both_paths(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    codec = make_codec(spec)
    n = 3001
    x = torch.randn(n, generator=torch.Generator().manual_seed(11)) * 2
    for payload in _both_paths(monkeypatch, lambda: codec.encode(x, torch.Generator().manual_seed(3))):
        fused, reference = _both_paths(monkeypatch, lambda p=payload: codec.decode(p, n))
        assert torch.equal(fused, reference), spec
        accumulated = _both_paths(monkeypatch, lambda p=payload: _accumulate(codec, p, n))
        assert torch.allclose(*accumulated, rtol=0, atol=1e-6), spec


def _accumulate(codec, payload: bytes, n: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.linspace(-1, 1, n)
    codec.decode_into(payload, out, alpha=0.5)
    return out


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "topk:ratio=0.05", "threshold:value=1.5"])
def test_deterministic_codecs_write_the_same_bytes_on_both_paths(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    codec = make_codec(spec)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 100
    x[7] = 1e6  # beyond fp16's range: clamped on both paths
    fused, reference = _both_paths(monkeypatch, lambda: codec.encode(x))
    assert fused == reference


def test_sampled_topk_keeps_the_k_largest_of_its_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = make_codec("topk:ratio=0.01,sample=0.05")
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(4))
    fused, reference = _both_paths(monkeypatch, lambda: codec.decode(codec.encode(x, torch.Generator().manual_seed(9)),
                                                                      x.numel()))
    for decoded in (fused, reference):
        kept = decoded != 0
        assert int(kept.sum()) <= 2000
        assert torch.equal(decoded[kept], x[kept])  # fp32 values, exact
    # same generator, same probe, same threshold: the same coordinates
    assert torch.equal(fused != 0, reference != 0)


@given(st.lists(st.integers(0, 2**40), min_size=0, max_size=200, unique=True))
def test_varint_kernel_matches_numpy(values: list[int]) -> None:
    from fedge.compression import varint

    indices = np.array(sorted(values), dtype=np.int64)
    fused = varint.encode_indices(indices)
    assert kernels.varint_decode(np.frombuffer(fused, np.uint8), indices.size, 2**41).tolist() == indices.tolist()
    original = kernels.available
    try:
        kernels.available = lambda: False  # type: ignore[assignment]
        assert varint.encode_indices(indices) == fused
        decoded = varint.decode_indices(fused, indices.size, 2**41) if indices.size else np.zeros(0, np.int64)
    finally:
        kernels.available = original  # type: ignore[assignment]
    assert decoded.tolist() == indices.tolist()


def test_index_gaps_that_would_wrap_the_sum_are_rejected_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedge.compression.varint import decode_indices

    huge_gaps = bytes([0xFF] * 5 + [0x7F]) * 5  # five gaps of 2^42 - 1: their sum wraps nothing now
    for result in _both_paths(monkeypatch, lambda: _raises(lambda: decode_indices(huge_gaps, 5, 1000))):
        assert isinstance(result, PayloadError) and "out of range" in str(result)


def _raises(fn):  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test inspects which type it was
        return err
    return None


@pytest.mark.parametrize("spec", ["sign", "onebit"])
def test_scale_overflow_is_refused_on_the_fused_path(spec: str) -> None:
    with pytest.raises(ValueError, match="overflows float32"):
        make_codec(spec).encode(torch.full((512,), 3e38))


def test_variable_size_values_codecs_are_refused() -> None:
    from fedge.compression import SpecError

    for spec in ("randk:ratio=0.1+zstd:level=3+qsgd:bits=4", "topk:ratio=0.1+zstd:level=3+qsgd:bits=4"):
        with pytest.raises(SpecError, match="fixed-size dense codec"):
            make_codec(spec)


def test_numba_is_loaded_only_when_a_codec_first_needs_the_fused_path() -> None:
    """The CLI's checks (the contractivity check included) run without loading numba: it costs
    about a second of CPU at the start of every run that never encodes; the first codec that asks
    for the fused path loads it."""
    code = (
        "import sys\n"
        "from fedge.server.preflight import preflight\n"
        "from fedge.server.settings import RunSettings\n"
        "preflight(RunSettings(codec='qsgd:bits=4', downlink_codec='lattice:ratio=0.05'), num_partitions=10)\n"
        "assert 'numba' not in sys.modules, 'numba loaded by the checks'\n"
        "from fedge.compression import kernels\n"
        "assert kernels.available() and 'numba' in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FEDGE_KERNELS"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


_CACHE_PROBE = """
import json, torch
from fedge.compression import jit, make_codec
x = torch.linspace(-1.0, 1.0, 4096)
for spec in ("qsgd:bits=4", "qsgd:bits=2", "terngrad"):
    wire = make_codec(spec).for_round(1, 0)
    wire.decode(wire.encode(x, torch.Generator().manual_seed(0)), 4096)
kernels = [f for f in vars(jit).values() if hasattr(f, "stats")]
kernels += [f for fs in jit.BY_BITS.values() for f in fs]
print(json.dumps({"file": jit.__file__, "hits": sum(sum(f.stats.cache_hits.values()) for f in kernels),
                  "misses": sum(sum(f.stats.cache_misses.values()) for f in kernels)}))
"""


def test_every_copy_of_the_kernels_shares_one_compiled_cache(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Flower app bundle installs fedge afresh under each run's FLWR_HOME: with numba's per-directory
    cache every run compiled every kernel again. Two copies of the code at different paths, as two
    runs' bundles: the first compiles, the second loads all it uses from the cache, compiling none."""
    from fedge.compression.kernel_cache import kernel_cache_path
    from fedge.launcher.app_bundle import stage_packages

    copies = [stage_packages(tmp_path / name, "", ["fedge.compression"]) for name in ("run-1", "run-2")]
    env = {k: v for k, v in os.environ.items() if k not in ("FEDGE_KERNELS", "NUMBA_CACHE_DIR",
                                                              "NUMBA_CACHE_LOCATOR_CLASSES")}
    env["FEDGE_CACHE_DIR"] = str(tmp_path / "cache")
    seen = []
    for copy in copies:
        done = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env={**env, "PYTHONPATH": str(copy)},
                              capture_output=True, text=True, timeout=300, check=True)
        seen.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert [s["file"] for s in seen] == [str(c / "fedge" / "compression" / "jit.py") for c in copies]
    assert seen[0]["misses"] > 0 and seen[0]["hits"] == 0, seen[0]
    assert seen[1]["misses"] == 0 and seen[1]["hits"] > 0, seen[1]
    assert kernel_cache_path(copies[0] / "fedge" / "compression" / "jit.py") == \
        kernel_cache_path(copies[1] / "fedge" / "compression" / "jit.py")
    assert any(kernel_cache_path(copies[0] / "fedge" / "compression" / "jit.py").glob("*.nbi"))
