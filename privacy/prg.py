"""The mask generator: ChaCha20 keystream, read as uint32 words and reduced to the ring.

A mask must be uniform in Z_{2^r} and unpredictable without its 32-byte seed. ChaCha20 (from
``cryptography``, OpenSSL underneath: about a gigabyte per second here) gives both; 2^r divides 2^32,
so keeping the low r bits of uniform 32-bit words is uniform too. (Flower's SecAgg+ seeds NumPy's
Mersenne Twister with 32 bits of the seed: guessable, and not a cryptographic generator.)
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedge.privacy.ring import ring_mask

__all__ = ["mask"]

_NONCE = bytes(16)  # each key is used for exactly one stream (HKDF labels make keys unique per pair and round)


def mask(seed: bytes, count: int, bits: int) -> np.ndarray:
    """``count`` uniform elements of Z_{2^bits} (uint32) from a 32-byte ``seed``."""
    if len(seed) != 32:
        raise ValueError(f"a mask seed is 32 bytes, got {len(seed)}")
    encryptor = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    stream = encryptor.update(bytes(4 * count))
    words = np.frombuffer(stream, dtype="<u4").astype(np.uint32)
    if bits < 32:
        words &= ring_mask(bits)
    return words
