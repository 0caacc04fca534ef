"""Two facts of the wire format, measured: the payload checksum's speed, and bits per sparse index.

* Checksum: XXH3-64 (what every payload carries) against ``zlib.crc32`` over the same 64 MiB buffer,
  best of R, in GB/s (10^9 bytes per second), side by side in one run.
* Sparse indices: bits per index of ``fedge.compression.index_sets`` (delta + varint, delta + Rice,
  and what the encoder sends: the smaller) for a uniformly random support at several densities of a
  1M-element vector, beside the entropy of the support, log2(C(n, k)) / k.

Prints both tables and the command; nothing is written.

    .venv/bin/python bench/wire_details.py [--repeat 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import zlib

import numpy as np
import xxhash

from fedge.compression import rice
from fedge.compression.index_sets import encode_index_set
from fedge.compression.varint import encode_indices


def _best(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)

    data = rng.integers(0, 256, size=64 << 20, dtype=np.uint8).tobytes()
    print("| checksum | GB/s (64 MiB, best of %d) |" % args.repeat)
    print("|---|---|")
    for name, fn in (("XXH3-64", lambda: xxhash.xxh3_64_intdigest(data)), ("zlib.crc32", lambda: zlib.crc32(data))):
        print(f"| {name} | {len(data) / _best(fn, args.repeat) / 1e9:.1f} |")

    n = 1_000_000
    print("\n| density | varint bits/index | Rice bits/index | sent bits/index | entropy bits/index |")
    print("|---|---|---|---|---|")
    for density in (0.001, 0.01, 0.05, 0.25):
        k = int(n * density)
        idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
        varint = len(encode_indices(idx)) * 8 / k
        gaps = (np.diff(idx, prepend=-1) - 1).astype(np.uint64)
        rice_bits = (1 + rice.encoded_size(gaps, rice.best_parameter(gaps))) * 8 / k
        sent = len(encode_index_set(idx)[1]) * 8 / k
        entropy = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2) / k
        print(f"| {density:.1%} | {varint:.2f} | {rice_bits:.2f} | {sent:.2f} | {entropy:.2f} |")
    print(f"\ncommand: {' '.join([sys.executable.split('/')[-1], *sys.argv])}")


if __name__ == "__main__":
    main()
