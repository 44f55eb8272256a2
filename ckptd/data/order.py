"""A global sample order that does not depend on the world: position ``p`` of the training
stream is sample ``order.index(p)``, whoever reads it.

The stream is epochs back to back: position ``p`` is in epoch ``p // length``, and each epoch is
a permutation of the dataset drawn from ``(seed, epoch)``. The permutation is computed, not
stored: a 4-round Feistel network over the smallest even power of two that holds the dataset,
keyed by xxh3 of ``(seed, epoch, round)``, with cycle walking to stay inside ``[0, length)``
(a permutation of a superset, restricted by walking, is a permutation of the set). So a position
maps to its sample in O(1) time and memory — a billion-sample dataset needs no index array — and
the same seed gives the same order on every machine and every version of torch.

:class:`ShardedOrder` is the same idea for data stored as files (shards) of known lengths: each
epoch reads the shards in a permuted order, each shard from its start, so a position is a
``(shard, offset)`` — what a reader of record files with an index, or of token-packed arrays,
needs to seek. No torch here.
"""

from __future__ import annotations

import bisect
import operator
import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import xxhash

from ckptd.errors import CkptdError


class DataMismatch(CkptdError, ValueError):
    """The data order of a resume differs from the checkpoint's (its length, seed, shards or
    algorithm), or cannot be continued exactly on the new world."""


ORDER_ALGORITHM = "feistel-xxh3-4r/1"  # part of the fingerprint: a change here changes orders
ROUNDS = 4
MAX_POSITION = 1 << 62  # lengths and stream positions: above this no dataset is real


def integer(value: Any, what: str, lo: int = 0, hi: int = MAX_POSITION) -> int:
    """``value`` as an int when it is an integer (a Python or numpy one, not a bool) in
    ``[lo, hi)``; else ValueError naming ``what``."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)  # numpy's bool: TypeError
    except TypeError:
        n = None
    if n is None or not lo <= n < hi:
        raise ValueError(f"{what} must be an integer in [{lo}, {_bound(hi)}), got {value!r}")
    return n


def _bound(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n > 1 << 32 and n & (n - 1) == 0 else str(n)


class Permutation:
    """A permutation of ``[0, n)`` drawn from ``key`` (integers); identity when not
    ``shuffle``."""

    __slots__ = ("n", "key", "shuffle", "_half", "_mask")

    def __init__(self, n: int, key: tuple[int, ...], shuffle: bool = True) -> None:
        self.n, self.key, self.shuffle = n, key, shuffle
        self._half = (max(2, (n - 1).bit_length()) + 1) // 2  # each Feistel half, in bits
        self._mask = (1 << self._half) - 1

    def _encrypt(self, x: int) -> int:
        fmt = f"<{len(self.key) + 2}Q"
        left, right = x >> self._half, x & self._mask
        for r in range(ROUNDS):
            f = xxhash.xxh3_64_intdigest(struct.pack(fmt, *self.key, r, right)) & self._mask
            left, right = right, left ^ f
        return (left << self._half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside [0, {self.n})")
        if not self.shuffle or self.n == 1:
            return i
        x = self._encrypt(i)
        while x >= self.n:  # the domain is below 4 n: a few steps on average
            x = self._encrypt(x)
        return x


def _check_seed(seed: int) -> int:
    return integer(seed, "seed", 0, 1 << 64)


class GlobalOrder:
    """Map-style data: position ``p`` of the stream is sample ``index(p)`` of a dataset of
    ``length`` samples, epoch ``p // length`` shuffled by ``(seed, epoch)``."""

    def __init__(self, length: int, *, seed: int = 0, shuffle: bool = True) -> None:
        self.length = integer(length, "a dataset's length (at least one sample)", 1)
        self.seed, self.shuffle = _check_seed(seed), shuffle

    def epoch(self, position: int) -> int:
        return position // self.length

    def index(self, position: int) -> int:
        if position < 0:
            raise IndexError(f"stream position {position} < 0")
        epoch, i = divmod(position, self.length)
        return _permutation(self.length, (self.seed, epoch), self.shuffle)(i)

    def spec(self) -> dict[str, Any]:
        """The fingerprint saved with a checkpoint (see :func:`check_spec`)."""
        return _spec("global", length=self.length, seed=self.seed, shuffle=self.shuffle)


class ShardedOrder:
    """Data in shards (files) of known lengths: each epoch visits the shards in an order
    shuffled by ``(seed, epoch)`` (or as listed with ``shuffle=False``), each shard read from its
    first record to its last. ``index(p)`` is ``(shard, offset)``."""

    def __init__(self, shard_lengths: Sequence[int], *, seed: int = 0,
                 shuffle: bool = True) -> None:
        lengths = [integer(n, f"shard length {i}") for i, n in enumerate(shard_lengths)]
        if sum(lengths) < 1 or sum(lengths) >= MAX_POSITION:
            raise ValueError(f"shards need at least one record (and fewer than 2^62), got "
                             f"{list(shard_lengths)[:8]!r}")
        self.lengths, self.seed, self.shuffle = lengths, _check_seed(seed), shuffle
        self.length = sum(lengths)

    def epoch(self, position: int) -> int:
        return position // self.length

    def _layout(self, epoch: int) -> tuple[list[int], list[int]]:
        return _shard_layout(tuple(self.lengths), self.seed, epoch, self.shuffle)

    def index(self, position: int) -> tuple[int, int]:
        if position < 0:
            raise IndexError(f"stream position {position} < 0")
        epoch, i = divmod(position, self.length)
        order, starts = self._layout(epoch)
        k = bisect.bisect_right(starts, i) - 1
        return order[k], i - starts[k]

    def spec(self) -> dict[str, Any]:
        lengths = struct.pack(f"<{len(self.lengths)}Q", *self.lengths)
        return _spec("sharded", length=self.length, seed=self.seed, shuffle=self.shuffle,
                     shards=len(self.lengths),
                     shard_lengths=f"{xxhash.xxh3_64_intdigest(lengths):016x}")


class StreamOrder:
    """Data that each reader (a rank, or each of its DataLoader workers) streams on its own,
    without offsets another reader could seek to: an ``IterableDataset`` handing out shards per
    worker, a network stream. Its position cannot be carried to another number of readers, so
    there is no sampler; recording its fingerprint (``ElasticRun.check_data``) makes a resume
    with another number of readers fail loudly instead of silently changing the order."""

    def __init__(self, readers: int, *, seed: int = 0) -> None:
        if not isinstance(readers, int) or readers < 1:
            raise ValueError(f"readers must be a positive integer, got {readers!r}")
        self.readers, self.seed = readers, _check_seed(seed)

    def spec(self) -> dict[str, Any]:
        return _spec("per-reader-streams", readers=self.readers, seed=self.seed)


@lru_cache(maxsize=64)
def _permutation(n: int, key: tuple[int, ...], shuffle: bool) -> Permutation:
    return Permutation(n, key, shuffle)


@lru_cache(maxsize=4)
def _shard_layout(lengths: tuple[int, ...], seed: int, epoch: int,
                  shuffle: bool) -> tuple[list[int], list[int]]:
    """The shards of ``epoch`` in reading order (empty ones left out) and where each starts."""
    perm = Permutation(len(lengths), (seed, epoch, 1), shuffle)
    order = [s for s in (perm(i) for i in range(len(lengths))) if lengths[s]]
    starts, at = [], 0
    for s in order:
        starts.append(at)
        at += lengths[s]
    return order, starts


def _spec(kind: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "algorithm": ORDER_ALGORITHM, **fields}


def check_spec(saved: dict[str, Any] | None, current: dict[str, Any], *,
               allow_change: bool = False) -> None:
    """Raise :class:`~ckptd.errors.DataMismatch` naming every field of the data order that
    differs from the checkpoint's, unless ``allow_change`` (the caller changed it on purpose: the
    run then continues at the same stream position of the new order, and exactly-once holds
    only from there). No saved spec: nothing to compare (a checkpoint from before it existed)."""
    if saved is None or allow_change:
        return
    keys = sorted(set(saved) | set(current))
    changed = [f"{k} {saved.get(k)!r} -> {current.get(k)!r}" for k in keys
               if saved.get(k) != current.get(k)]
    if changed:
        raise DataMismatch(
            f"the data order differs from the checkpoint's: {', '.join(changed)}; resuming "
            "would repeat or skip samples (pass allow_data_change=True if the change is "
            "intended)")
