"""Keyed permutations of ``[0, n)``: the shuffles behind every data order (``order.py``).

A permutation is drawn from a key (a tuple of integers: the seed, the epoch, ...) and is the
same on every machine and every version of numpy and torch: nothing here depends on a library's
random generator. Two algorithms, each a string in the order's fingerprint:

- :data:`ALGORITHM` (version 2). Below :data:`EXACT_BELOW` elements, an exact shuffle: the
  permutation is materialised by Fisher–Yates, its swaps drawn from SplitMix64 started at a key
  hashed by xxh3 (each draw reduced modulo ``i + 1``: a bias below ``n / 2^64``). From
  :data:`EXACT_BELOW` on, computed without memory: an 8-round alternating Feistel network over
  ``[0, a) × [0, b)`` with ``a`` the even number at or above ``√n`` and ``b = ⌈n / a⌉``, each round
  adding an xxh3 hash of one half to the other modulo its size, and cycle walking back into
  ``[0, n)`` (``a·b − n < a``: one step in ``a`` walks once). The sums modulo an even ``a``
  make odd and even permutations alike.
- :data:`LEGACY` (version 1): a 4-round Feistel network with xor over the smallest even power
  of two that holds ``n``. Not uniform for small ``n`` (and only even permutations when ``n`` is
  a power of 4); kept so that a run started with it can finish the epoch it is in.
"""

from __future__ import annotations

import math
import struct
from array import array

import numpy as np
import xxhash

ALGORITHM = "fy4096-feistel8-xxh3/2"
LEGACY = "feistel-xxh3-4r/1"
ALGORITHMS = (ALGORITHM, LEGACY)
EXACT_BELOW = 4096  # below this many elements a permutation is materialised (32 KiB at most)
ROUNDS = 8

_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_hash = xxhash.xxh3_64_intdigest


def round_keys(key: tuple[int, ...], count: int) -> list[int]:
    """``count`` 64-bit keys drawn from ``key``: xxh3 of ``(*key, r)`` for ``r < count``."""
    pack = struct.Struct(f"<{len(key) + 1}Q").pack
    return [_hash(pack(*key, r)) for r in range(count)]


def splitmix(start: int, count: int) -> np.ndarray:
    """The first ``count`` outputs of SplitMix64 from state ``start`` (uint64 array)."""
    z = np.arange(1, count + 1, dtype=np.uint64)
    z *= np.uint64(_GAMMA)
    z += np.uint64(start)
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return z


def fisher_yates(n: int, start: int) -> array[int]:
    """A uniformly drawn permutation of ``[0, n)`` as an ``array('q')``: Fisher–Yates from the
    top, the swap partner of ``i`` the ``i``-th SplitMix64 draw from ``start`` modulo ``i + 1``."""
    out = array("q", range(n))
    if n < 2:
        return out
    mods = splitmix(start, n - 1)
    mods %= np.arange(2, n + 1, dtype=np.uint64)
    draws = array("q")  # 8 bytes a draw (a list would hold an int object for each)
    draws.frombytes(mods.data.cast("B"))
    for i in range(n - 1, 0, -1):
        j = draws[i - 1]
        out[i], out[j] = out[j], out[i]
    return out


class Permutation:
    """A permutation of ``[0, n)``: ``p(i)`` is the element at place ``i``. The identity here;
    :func:`permutation` chooses the kind."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside [0, {self.n})")
        return i


class Table(Permutation):
    """A materialised permutation (Fisher–Yates)."""

    __slots__ = ("table",)

    def __init__(self, n: int, start: int) -> None:
        super().__init__(n)
        self.table = fisher_yates(n, start)

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside [0, {self.n})")
        return self.table[i]


class Feistel(Permutation):
    """Version 2's computed permutation (the module docstring): O(1) memory, ``ROUNDS`` hashes
    per element (and rarely a second pass of cycle walking)."""

    __slots__ = ("_a", "_b", "_pairs")

    def __init__(self, n: int, keys: list[int]) -> None:
        super().__init__(n)
        a = max(2, math.isqrt(n - 1) + 1)  # ⌈√n⌉
        self._a = a + (a & 1)
        self._b = -(-n // self._a)
        self._pairs = list(zip(keys[0::2], keys[1::2], strict=True))

    def _encrypt(self, x: int) -> int:
        a, b, h = self._a, self._b, _hash
        hi, lo = divmod(x, b)  # hi in [0, a), lo in [0, b)
        for k0, k1 in self._pairs:
            hi, lo = lo, (hi + h(lo.to_bytes(8, "little"), k0)) % a  # now [0, b) x [0, a)
            hi, lo = lo, (hi + h(lo.to_bytes(8, "little"), k1)) % b  # back to [0, a) x [0, b)
        return hi * b + lo

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside [0, {self.n})")
        x = self._encrypt(i)
        while x >= self.n:  # a·b - n < a: rarely
            x = self._encrypt(x)
        return x


class FeistelV1(Permutation):
    """Version 1 (:data:`LEGACY`), unchanged: 4 xor rounds over 2^(2h) ≥ n, cycle walking."""

    __slots__ = ("key", "_half", "_mask", "_fmt")

    def __init__(self, n: int, key: tuple[int, ...]) -> None:
        super().__init__(n)
        self.key = key
        self._half = (max(2, (n - 1).bit_length()) + 1) // 2  # each Feistel half, in bits
        self._mask = (1 << self._half) - 1
        self._fmt = struct.Struct(f"<{len(key) + 2}Q")

    def _encrypt(self, x: int) -> int:
        left, right = x >> self._half, x & self._mask
        for r in range(4):
            f = _hash(self._fmt.pack(*self.key, r, right)) & self._mask
            left, right = right, left ^ f
        return (left << self._half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside [0, {self.n})")
        x = self._encrypt(i)
        while x >= self.n:  # the domain is below 4 n: a few steps on average
            x = self._encrypt(x)
        return x


def permutation(n: int, key: tuple[int, ...], *, shuffle: bool = True,
                algorithm: str = ALGORITHM) -> Permutation:
    """The permutation of ``[0, n)`` drawn from ``key`` by ``algorithm``; the identity when not
    ``shuffle``."""
    if not shuffle or n < 2:
        return Permutation(n)
    if algorithm == LEGACY:
        return FeistelV1(n, key)
    if algorithm != ALGORITHM:
        raise ValueError(f"unknown order algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    if n < EXACT_BELOW:
        return Table(n, round_keys(key, 1)[0])
    return Feistel(n, round_keys(key, ROUNDS))


def shuffled(n: int, key: tuple[int, ...]) -> np.ndarray:
    """A Fisher–Yates permutation of ``[0, n)`` drawn from ``key``, whatever ``n``, as an int64
    array: for what is materialised anyway (the shards of an epoch)."""
    return np.frombuffer(fisher_yates(n, round_keys(key, 1)[0]), dtype=np.int64)
