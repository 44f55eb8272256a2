"""A global sample order that does not depend on the world: position ``p`` of the training
stream is sample ``order.index(p)``, whoever reads it.

The stream is epochs back to back: position ``p`` is in epoch ``p // length``, and each epoch is
a permutation of the dataset drawn from ``(seed, epoch)`` (``permutation.py``: exact below 4096
samples, computed in O(1) time and memory above). A billion-sample dataset needs no index array,
and the same seed gives the same order on every machine and every version of torch.

:class:`ShardedOrder` is the same idea for data stored as files (shards) of known lengths: each
epoch shuffles the shards, groups them in blocks of a few, and reads each block's records in a
shuffled order, so that a batch mixes shards while a reader needs only a few at a time; a
position is a ``(shard, offset)`` — what a reader of record files with an index, or of
token-packed arrays, needs to seek. The layout of an epoch is computed once (O(shards)); a
position then costs two binary searches and one permutation. No torch here.
"""

from __future__ import annotations

import operator
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import xxhash

from ckptd.data.permutation import ALGORITHM, ALGORITHMS, LEGACY, Permutation, permutation, shuffled
from ckptd.errors import CkptdError


class DataMismatch(CkptdError, ValueError):
    """The data order of a resume differs from the checkpoint's (its length, seed, shards or
    algorithm), or cannot be continued exactly on the new world.

    Example:
        from ckptd.data import DataMismatch, GlobalOrder, check_spec

        saved = GlobalOrder(100, seed=1).spec()
        try:
            check_spec(saved, GlobalOrder(100, seed=2).spec())
        except DataMismatch as e:
            assert "seed 1 -> 2" in str(e)
        else:
            raise AssertionError("no error")
    """


ORDER_ALGORITHM = ALGORITHM  # part of the fingerprint: a change here changes orders
BLOCK_SHARDS = 16  # a ShardedOrder's default: shards per shuffle block
_KEEP_EPOCHS = 2  # per order: the epoch being read and the next (a batch may straddle them)
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


def _check_seed(seed: int) -> int:
    return integer(seed, "seed", 0, 1 << 64)


class Order(Protocol):
    """What a sampler reads: :class:`GlobalOrder`, :class:`ShardedOrder`, or a stream of them
    across a change of the data (:class:`ckptd.data.stream.Stream`)."""

    length: int

    def index(self, position: int) -> Any: ...

    def epoch(self, position: int) -> int: ...

    def spec(self) -> dict[str, Any]: ...


def _check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown order algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    return algorithm


class _Epochs:
    """What an order computes once per epoch, kept for the last few epochs."""

    def __init__(self) -> None:
        self._kept: dict[int, Any] = {}

    def get(self, epoch: int, make: Any) -> Any:
        got = self._kept.get(epoch)
        if got is None:
            got = self._kept[epoch] = make(epoch)
            while len(self._kept) > _KEEP_EPOCHS:
                del self._kept[next(iter(self._kept))]
        return got


class GlobalOrder:
    """Map-style data: position ``p`` of the stream is sample ``index(p)`` of a dataset of
    ``length`` samples, epoch ``p // length`` shuffled by ``(seed, epoch)``. ``algorithm``: the
    newest by default; an older one (:data:`~ckptd.data.permutation.ALGORITHMS`) reproduces the
    orders of the ckptd versions that had it.

    Args:
        length: the dataset's number of samples (at least 1; an integer, not a float or bool).
        seed: the shuffle's seed (an integer).
        shuffle: False: every epoch reads the samples in order.
        algorithm: the permutation's algorithm name (part of the fingerprint).

    Raises:
        ValueError: a length, seed or algorithm that is not valid, named.

    Example:
        from ckptd.data import GlobalOrder

        order = GlobalOrder(10, seed=3)
        epoch0 = [order.index(p) for p in range(10)]
        assert sorted(epoch0) == list(range(10))  # a permutation of the dataset
        assert order.epoch(12) == 1
        assert order.spec()["seed"] == 3
    """

    def __init__(self, length: int, *, seed: int = 0, shuffle: bool = True,
                 algorithm: str = ORDER_ALGORITHM) -> None:
        self.length = integer(length, "a dataset's length (at least one sample)", 1)
        self.seed, self.shuffle = _check_seed(seed), bool(shuffle)
        self.algorithm = _check_algorithm(algorithm)
        self._epochs = _Epochs()

    def epoch(self, position: int) -> int:
        """The epoch stream position ``position`` is in: ``position // length``.

        Args:
            position: a stream position (0 or more).

        Returns:
            The epoch number.
        """
        return position // self.length

    def _permutation(self, epoch: int) -> Permutation:
        return permutation(self.length, (self.seed, epoch), shuffle=self.shuffle,
                           algorithm=self.algorithm)

    def index(self, position: int) -> int:
        """The sample stream position ``position`` reads.

        Args:
            position: a stream position (0 or more).

        Returns:
            The sample index in ``[0, length)``.

        Raises:
            IndexError: a negative position.
        """
        if position < 0:
            raise IndexError(f"stream position {position} < 0")
        epoch, i = divmod(position, self.length)
        perm: Permutation = self._epochs.get(epoch, self._permutation)
        return perm(i)

    def spec(self) -> dict[str, Any]:
        """The fingerprint saved with a checkpoint (see :func:`check_spec`)."""
        return {"kind": "global", "algorithm": self.algorithm, "length": self.length,
                "seed": self.seed, "shuffle": self.shuffle}


class ShardedOrder:
    """Data in shards (files) of known record counts; ``index(p)`` is ``(shard, offset)``.

    Each epoch shuffles the shards by ``(seed, epoch)``, cuts that sequence into blocks of at
    most ``block_shards`` shards (as even as can be), and reads the blocks one after another,
    the records of a block in an order shuffled by ``(seed, epoch, block)``: a batch draws from
    up to ``block_shards`` shards, and a reader holds that many at a time. ``block_shards=1``
    shuffles each shard on its own; with ``shuffle=False`` the shards are read as listed, each
    from its first record to its last. Empty shards are allowed (never read).

    Args:
        shard_lengths: the record count of each shard, in the shards' order.
        seed: the shuffle's seed (an integer).
        shuffle: False: read the shards as listed, each in order.
        block_shards: shards read together (at least 1).
        algorithm: the permutation's algorithm name (part of the fingerprint).

    Raises:
        ValueError: no records at all, or a length, seed or algorithm that is not valid.

    Example:
        from ckptd.data import ShardedOrder

        order = ShardedOrder([3, 0, 2], seed=7)
        epoch0 = sorted(order.index(p) for p in range(5))
        assert epoch0 == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]
    """

    def __init__(self, shard_lengths: Sequence[int] | np.ndarray, *, seed: int = 0,
                 shuffle: bool = True,
                 block_shards: int = BLOCK_SHARDS, algorithm: str = ORDER_ALGORITHM) -> None:
        self.lengths = _shard_lengths(shard_lengths)
        fits = int(self.lengths.max(initial=0)) < MAX_POSITION // max(1, len(self.lengths))
        self.length = int(self.lengths.sum()) if fits else sum(self.lengths.tolist())  # no overflow
        if not 1 <= self.length < MAX_POSITION:
            raise ValueError(f"shards need at least one record (and fewer than 2^62 in all), got "
                             f"{list(shard_lengths)[:8]!r}")
        self.seed, self.shuffle = _check_seed(seed), bool(shuffle)
        self.block_shards = integer(block_shards, "block_shards", 1)
        self.algorithm = _check_algorithm(algorithm)
        self._epochs = _Epochs()

    def epoch(self, position: int) -> int:
        """The epoch stream position ``position`` is in: ``position // length``.

        Args:
            position: a stream position (0 or more).

        Returns:
            The epoch number.
        """
        return position // self.length

    def _layout(self, epoch: int) -> _Layout | _LayoutV1:
        if self.algorithm == LEGACY:
            return _LayoutV1(self, epoch)
        return _Layout(self, epoch)

    def index(self, position: int) -> tuple[int, int]:
        """The record stream position ``position`` reads.

        Args:
            position: a stream position (0 or more).

        Returns:
            ``(shard, offset)``: the shard's index in ``shard_lengths`` and the record in it.

        Raises:
            IndexError: a negative position.
        """
        if position < 0:
            raise IndexError(f"stream position {position} < 0")
        epoch, i = divmod(position, self.length)
        layout: _Layout | _LayoutV1 = self._epochs.get(epoch, self._layout)
        return layout.index(i)

    def spec(self) -> dict[str, Any]:
        """The fingerprint saved with a checkpoint (see :func:`check_spec`): the shards'
        lengths as a hash."""
        lengths = self.lengths.astype("<u8").tobytes()
        spec = {"kind": "sharded", "algorithm": self.algorithm, "length": self.length,
                "seed": self.seed, "shuffle": self.shuffle, "shards": len(self.lengths),
                "shard_lengths": f"{xxhash.xxh3_64_intdigest(lengths):016x}"}
        if self.algorithm != LEGACY:
            spec["block_shards"] = self.block_shards
        return spec


def _shard_lengths(given: Sequence[int] | np.ndarray) -> np.ndarray:
    """The record counts as an int64 array, each an integer in [0, 2^62) (numpy ones too)."""
    if isinstance(given, np.ndarray) and given.dtype.kind in "iu" and given.ndim == 1:
        bad = np.flatnonzero((given < 0) | (given >= MAX_POSITION))
        if len(bad):
            integer(given[bad[0]], f"shard length {bad[0]}")  # raises, naming it
        return given.astype(np.int64)
    return np.array([integer(n, f"shard length {i}") for i, n in enumerate(given)],
                    dtype=np.int64)


class _Layout:
    """One epoch of a :class:`ShardedOrder`: the shuffled shards (empty ones left out), where
    each block of them starts in the epoch, and the last few blocks read (their shards, where
    each starts inside the block, the block's permutation)."""

    def __init__(self, order: ShardedOrder, epoch: int) -> None:
        ids = np.flatnonzero(order.lengths)
        if order.shuffle:
            ids = ids[shuffled(len(ids), (order.seed, epoch, 1))]
        self.shards = ids.astype(np.int32 if len(ids) < 1 << 31 else np.int64)
        n = len(ids)
        self.blocks = -(-n // order.block_shards)
        bounds = np.arange(self.blocks + 1, dtype=np.int64) * n // self.blocks
        ends = np.cumsum(order.lengths[ids])
        self.starts = array("q", [0])
        self.starts.frombytes(ends[bounds[1:] - 1].astype(np.int64).tobytes())
        self._order, self._epoch = order, epoch
        self._read: dict[int, tuple[list[int], list[int], Permutation]] = {}

    def _block(self, j: int) -> tuple[list[int], list[int], Permutation]:
        got = self._read.get(j)
        if got is None:
            n, o = len(self.shards), self._order
            shards = self.shards[j * n // self.blocks:(j + 1) * n // self.blocks]
            ends = np.cumsum(o.lengths[shards]).tolist()
            got = (shards.tolist(), [0, *ends[:-1]],
                   permutation(ends[-1], (o.seed, self._epoch, 2, j), shuffle=o.shuffle))
            self._read[j] = got
            if len(self._read) > 4:
                del self._read[next(iter(self._read))]
        return got

    def index(self, i: int) -> tuple[int, int]:
        j = bisect_right(self.starts, i) - 1
        shards, starts, perm = self._block(j)
        r = perm(i - self.starts[j])
        k = bisect_right(starts, r) - 1
        return shards[k], r - starts[k]


class _LayoutV1:
    """One epoch of a :class:`ShardedOrder` of the legacy algorithm: the shards in a permuted
    order, each from its first record to its last (no blocks)."""

    def __init__(self, order: ShardedOrder, epoch: int) -> None:
        lengths = order.lengths.tolist()
        perm = permutation(len(lengths), (order.seed, epoch, 1), shuffle=order.shuffle,
                           algorithm=LEGACY)
        self.shards = [s for s in map(perm, range(len(lengths))) if lengths[s]]
        self.starts, at = [], 0
        for s in self.shards:
            self.starts.append(at)
            at += lengths[s]

    def index(self, i: int) -> tuple[int, int]:
        k = bisect_right(self.starts, i) - 1
        return self.shards[k], i - self.starts[k]


class StreamOrder:
    """Data that each reader (a rank, or each of its DataLoader workers) streams on its own,
    without offsets another reader could seek to: an ``IterableDataset`` handing out shards per
    worker, a network stream. Its position cannot be carried to another number of readers, so
    there is no sampler; recording its fingerprint (``ElasticRun.check_data``) makes a resume
    with another number of readers fail loudly instead of silently changing the order.

    Args:
        readers: the number of readers (at least 1).
        seed: the readers' seed, part of the fingerprint.

    Example:
        from ckptd.data import DataMismatch, StreamOrder, check_spec

        saved = StreamOrder(8).spec()
        check_spec(saved, StreamOrder(8).spec())  # the same readers: fine
        try:
            check_spec(saved, StreamOrder(4).spec())
        except DataMismatch as e:
            assert "readers 8 -> 4" in str(e)
        else:
            raise AssertionError("no error")
    """

    def __init__(self, readers: int, *, seed: int = 0) -> None:
        self.readers = integer(readers, "readers", 1)
        self.seed = _check_seed(seed)

    def spec(self) -> dict[str, Any]:
        """The fingerprint saved with a checkpoint (see :func:`check_spec`)."""
        return {"kind": "per-reader-streams", "algorithm": ORDER_ALGORITHM,
                "readers": self.readers, "seed": self.seed}


def changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each field of two fingerprints that differs, as ``"name old -> new"``. A stream read per
    reader has no order of ckptd's: its algorithm is not compared."""
    keys = sorted(set(saved) | set(current))
    if saved.get("kind") == current.get("kind") == "per-reader-streams":
        keys.remove("algorithm")
    return [f"{k} {saved.get(k)!r} -> {current.get(k)!r}" for k in keys
            if saved.get(k) != current.get(k)]


def check_spec(saved: dict[str, Any] | None, current: dict[str, Any], *,
               allow_change: bool = False) -> None:
    """Raise :class:`~ckptd.errors.DataMismatch` naming every field of the data order that
    differs from the checkpoint's, unless ``allow_change`` (the caller changed it on purpose;
    ``ckptd.data.stream`` decides which order reads what from there). No saved spec: nothing
    to compare (a checkpoint from before it existed).

    Args:
        saved: the checkpoint's fingerprint (an order's ``spec()``), or None.
        current: this run's order's ``spec()``.
        allow_change: accept a difference (the change is intended).

    Raises:
        DataMismatch: the fingerprints differ, naming each field (``seed 1 -> 2``).

    Example:
        from ckptd.data import GlobalOrder, check_spec

        saved = GlobalOrder(100, seed=1).spec()
        check_spec(saved, GlobalOrder(100, seed=1).spec())
        check_spec(saved, GlobalOrder(120, seed=1).spec(), allow_change=True)
        check_spec(None, GlobalOrder(100).spec())  # nothing saved: nothing to compare
    """
    if saved is None or allow_change:
        return
    changed = changes(saved, current)
    if changed:
        raise DataMismatch(
            f"the data order differs from the checkpoint's: {', '.join(changed)}; resuming "
            "would repeat or skip samples (pass allow_data_change=True if the change is "
            "intended: the epoch in progress then finishes under the checkpoint's order)")
