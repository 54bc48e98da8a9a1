"""A keyed bijection on [0, n): shuffle without materializing a permutation.

A balanced Feistel network over the smallest even number of bits that covers n is a bijection on
[0, 2^bits); "cycle walking" (re-applying it to outputs >= n) restricts it to a bijection on
[0, n). Memory is O(1) whatever n is, so window orders over trillion-token corpora cost nothing,
and any position's window can be computed directly, which is what makes exact resume cheap.
Vectorized over numpy uint64 arrays; integer arithmetic wraps, so results are the same on every
platform.
"""

from __future__ import annotations

import hashlib
import operator

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def round_keys(*key_parts: int | str) -> np.ndarray:
    """ROUNDS 64-bit keys from any tuple of ints and strings (seed, epoch, ...). Any integer type
    gives the key of the same plain int: repr(np.int64(3)) is not repr(3)."""
    canonical = tuple(part if isinstance(part, str) else operator.index(part) for part in key_parts)
    digest = hashlib.blake2b(repr(canonical).encode(), digest_size=8 * ROUNDS).digest()
    return np.frombuffer(digest, dtype="<u8").copy()


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finalizer on x ^ key: every input bit affects every output bit."""
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, half_bits: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right, key) & mask)
    return (left << shift) | right


def permute(positions: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """The images of `positions` (each in [0, n)) under the bijection keyed by `keys`."""
    x = np.asarray(positions, dtype=np.uint64)
    if n <= 1:
        return x.astype(np.int64)
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    n64 = np.uint64(n)
    with np.errstate(over="ignore"):
        y = _feistel(x, bits // 2, keys)
        outside = y >= n64
        while outside.any():  # at most a few rounds: 2^bits < 4n
            y[outside] = _feistel(y[outside], bits // 2, keys)
            outside = y >= n64
    return y.astype(np.int64)
