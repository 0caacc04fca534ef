"""One derivation for every random stream of a run: ``derive_seed(seed, *words, purpose=...)``.

Client sampling, the initial model, each client's local shuffling, stochastic rounding, the
compressed downlink and random-k's shared support all draw from their own stream. Each stream is a
``numpy.random.SeedSequence`` over the run seed, the words that identify the draw (round, partition,
node) and a tag for the purpose, so that two purposes never share a stream by accident (the old
formulas ``seed * 1_000_003 + round`` and ``[seed, round]`` could collide) and a resumed run draws
exactly what an uninterrupted one would. The tag is a stable hash of the purpose string: Python's
``hash()`` is salted per process and would differ between the coordinator and the clients.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["derive_seed"]


def _tag(purpose: str) -> int:
    return int.from_bytes(hashlib.blake2b(purpose.encode("utf-8"), digest_size=8).digest(), "little")


def derive_seed(seed: int, *words: int, purpose: str) -> int:
    """A 63-bit seed (valid for ``torch.Generator.manual_seed`` and ``numpy.random.default_rng``)."""
    if not purpose:
        raise ValueError("derive_seed needs a purpose: streams of different purposes must differ")
    entropy = [int(seed), *(int(w) for w in words), _tag(purpose)]
    if any(w < 0 for w in entropy):
        raise ValueError(f"seed words must be non-negative integers, got {entropy[:-1]}")
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)
