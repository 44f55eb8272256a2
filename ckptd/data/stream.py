"""The training stream across changes of the data order: which order serves which positions.

A run's stream is one order from position 0 until a resume brings another (a new seed, more
samples or shards, another block size, a newer algorithm of ckptd). Then the epoch in progress
finishes under the order it started with — each of its samples exactly once — and the new order
starts at the next epoch boundary, numbering its epochs on from there: a *segment* is an order
with the stream position where it starts and the epoch number it starts with, and a stream is at
most two segments (the one finishing its epoch, the new one).

The checkpoint's data record (``TrainingMeta.data``) is the newest order's fingerprint
(``order.spec()``), with ``start`` and ``start_epoch`` when it does not start at position 0, and
``previous``: the record of the segment before it. An order is rebuilt from its record (and the
new order's shard lengths) to finish its epoch; when it cannot be — a dataset that shrank,
shards that changed other than by appending — the resume is refused with what
``allow_data_change="now"`` would skip instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ckptd.data.order import (
    BLOCK_SHARDS,
    DataMismatch,
    GlobalOrder,
    Order,
    ShardedOrder,
    changes,
    check_spec,
    integer,
)
from ckptd.data.permutation import ALGORITHMS

STREAM_KEYS = ("start", "start_epoch", "previous")
Change = bool | Literal["now"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """``order`` serves the stream from position ``start`` on, its epoch ``epoch`` first."""

    order: Order
    start: int = 0
    epoch: int = 0

    def position(self, p: int) -> int:
        """Stream position ``p`` as a position of ``order``'s own stream."""
        return self.epoch * self.order.length + p - self.start

    def epoch_at(self, p: int) -> int:
        return self.position(p) // self.order.length

    def left_in_epoch(self, p: int) -> int:
        """Positions from ``p`` to the end of its epoch (0 at a boundary)."""
        return -self.position(p) % self.order.length

    def record(self) -> dict[str, Any]:
        where = {} if (self.start, self.epoch) == (0, 0) else {"start": self.start,
                                                               "start_epoch": self.epoch}
        return {**self.order.spec(), **where}


class Stream:
    """The orders of a run's stream (:class:`Segment`): what a sampler reads."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.segments = tuple(segments)
        self.length = self.segments[-1].order.length

    def _segment(self, p: int) -> Segment:
        for s in reversed(self.segments):
            if p >= s.start:
                return s
        raise IndexError(f"stream position {p} is before the orders this run knows (from "
                         f"{self.segments[0].start})")

    def index(self, position: int) -> Any:
        if position < 0:
            raise IndexError(f"stream position {position} < 0")
        s = self._segment(position)
        return s.order.index(s.position(position))

    def epoch(self, position: int) -> int:
        return self._segment(position).epoch_at(position)

    def spec(self) -> dict[str, Any]:
        return self.segments[-1].order.spec()

    def simple(self) -> Order | None:
        """The one order when the stream is that order from position 0."""
        s = self.segments
        return s[0].order if len(s) == 1 and (s[0].start, s[0].epoch) == (0, 0) else None


@dataclasses.dataclass(frozen=True)
class _Saved:
    """A segment as the checkpoint recorded it: the order's fingerprint and where it starts."""

    spec: dict[str, Any]
    start: int
    epoch: int
    length: int

    @classmethod
    def parse(cls, record: Any) -> _Saved:
        if not isinstance(record, Mapping):
            raise DataMismatch(f"the checkpoint's data record is not an object: {record!r}")
        try:
            return cls({k: v for k, v in record.items() if k not in STREAM_KEYS},
                       integer(record.get("start", 0), "start"),
                       integer(record.get("start_epoch", 0), "start_epoch"),
                       integer(record.get("length"), "length", 1))
        except ValueError as e:
            raise DataMismatch(f"the checkpoint's data record is damaged: {e}") from None

    def epoch_at(self, p: int) -> int:
        return self.epoch + (p - self.start) // self.length

    def left_in_epoch(self, p: int) -> int:
        return -(p - self.start) % self.length


def continue_stream(saved: Mapping[str, Any] | None, consumed: int, order: Order, *,
                    allow_change: Change = False) -> tuple[Stream, dict[str, Any], str | None]:
    """The stream a run resumed at position ``consumed`` reads with ``order``, the data record
    its checkpoints carry from now on, and a note for the log (an upgrade of the algorithm).

    ``saved`` is the checkpoint's data record (None: a fresh run, or a checkpoint from before
    records). An order other than the saved one raises :class:`DataMismatch` naming what
    changed, unless it differs only by its algorithm (a newer ckptd) or ``allow_change``:
    ``True`` finishes the epoch in progress under the order it started with, then starts the
    new order; ``"now"`` starts a new epoch of the new order at ``consumed``, leaving the rest of
    the epoch in progress unread."""
    if allow_change not in (False, True, "now"):
        raise ValueError(f"allow_data_change must be False, True or 'now', got {allow_change!r}")
    current = order.spec()
    if saved is None:
        return Stream([Segment(order)]), current, None
    if saved.get("kind") not in ("global", "sharded"):  # no order of positions before
        check_spec(dict(saved), current, allow_change=bool(allow_change))
        return Stream([Segment(order, consumed)]), Segment(order, consumed).record(), None
    cur = _Saved.parse(saved)
    prev = _Saved.parse(saved["previous"]) if saved.get("previous") is not None else None
    finishing = prev is not None and consumed < cur.start
    active = prev if finishing and prev is not None else cur
    if active.start > consumed:
        raise DataMismatch(f"the checkpoint's data record starts its order at position "
                           f"{active.start}, after the {consumed} samples consumed")
    if cur.spec == current:  # nothing changed since the checkpoint
        segments = [Segment(order, cur.start, cur.epoch)]
        if finishing:
            segments.insert(0, Segment(_rebuilt(active, order, consumed, current), active.start,
                                       active.epoch))
        return Stream(segments), dict(saved), None
    upgrade = _algorithm_only(cur.spec, order)
    if not upgrade and not allow_change:
        check_spec(cur.spec, current)  # raises, naming the changes
    left = active.left_in_epoch(consumed)
    epoch = active.epoch_at(consumed) + (1 if left else 0)  # the new order's first epoch
    previous = {**active.spec, **({} if (active.start, active.epoch) == (0, 0) else
                                  {"start": active.start, "start_epoch": active.epoch})}
    if allow_change == "now" or not left:
        segments = [Segment(order, consumed, epoch)]
    else:
        old = _rebuilt(active, order, consumed, current)
        segments = [Segment(old, active.start, active.epoch),
                    Segment(order, consumed + left, epoch)]
    note = None
    if upgrade:
        finish = f"epoch {epoch - 1} finishes with it, and " if len(segments) == 2 else ""
        note = (f"ckptd: the checkpoint's data order uses algorithm {cur.spec['algorithm']!r}; "
                f"{finish}epoch {epoch} on (from stream position {segments[-1].start}) uses "
                f"{current['algorithm']!r} (pass algorithm={cur.spec['algorithm']!r} to the "
                "order to keep the old one)")
    return Stream(segments), {**segments[-1].record(), "previous": previous}, note


def epoch_at(record: Mapping[str, Any] | None, position: int) -> int | None:
    """The data epoch at a stream position, from a checkpoint's data record; None when the
    record does not reach back to it."""
    for r in (record, (record or {}).get("previous")):
        try:
            s = _Saved.parse(r)
        except DataMismatch:
            continue
        if position >= s.start:
            return s.epoch_at(position)
    return None


def _algorithm_only(saved: dict[str, Any], order: Order) -> bool:
    """Whether ``order`` is the saved order but for its algorithm (a known one)."""
    algorithm = saved.get("algorithm")
    if algorithm not in ALGORITHMS or not isinstance(order, GlobalOrder | ShardedOrder):
        return False
    if isinstance(order, GlobalOrder):
        other: Order = GlobalOrder(order.length, seed=order.seed, shuffle=order.shuffle,
                                   algorithm=algorithm)
    else:
        other = ShardedOrder(order.lengths, seed=order.seed, shuffle=order.shuffle,
                             block_shards=order.block_shards, algorithm=algorithm)
    return other.spec() == saved


def _rebuilt(active: _Saved, order: Order, consumed: int, current: dict[str, Any]) -> Order:
    """The order of the epoch in progress, rebuilt to finish it; else DataMismatch saying why
    and what ``allow_data_change="now"`` would skip instead."""
    old = _rebuild(active.spec, order)
    if not isinstance(old, str):
        return old
    epoch, left = active.epoch_at(consumed), active.left_in_epoch(consumed)
    raise DataMismatch(
        f"the data order changed ({', '.join(changes(active.spec, current))}) in the middle of "
        f"epoch {epoch} (stream position {consumed}: {active.length - left} of its "
        f"{active.length} positions read), and that epoch cannot finish under the order it "
        f"started with: {old}. allow_data_change='now' starts epoch {epoch + 1} of the new "
        f"order at position {consumed}: the {left} positions left of epoch {epoch} are not "
        f"read (the samples there that the new data still has are not read in epoch {epoch}, "
        f"and are from epoch {epoch + 1} on), and no sample is read twice within an epoch")


def _rebuild(spec: dict[str, Any], like: Order) -> Order | str:
    """The order ``spec`` describes, with shard lengths taken from ``like`` (its prefix); or
    why it cannot be read from ``like``'s data."""
    kind, algorithm = spec.get("kind"), spec.get("algorithm")
    if algorithm not in ALGORITHMS:
        return f"its algorithm {algorithm!r} is not one this version of ckptd has"
    old: Order
    try:
        shuffle = spec["shuffle"]
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be a bool, got {shuffle!r}")
        if kind == "global" and isinstance(like, GlobalOrder):
            n = integer(spec["length"], "length", 1)
            if n > like.length:
                return (f"the dataset shrank from {n} to {like.length} samples, and that order "
                        f"reads samples {like.length}..{n - 1}, which it no longer has")
            old = GlobalOrder(n, seed=spec["seed"], shuffle=shuffle, algorithm=algorithm)
        elif kind == "sharded" and isinstance(like, ShardedOrder):
            shards = integer(spec["shards"], "shards", 1)
            if shards > len(like.lengths):
                return (f"there are {len(like.lengths)} shards where there were {shards}, and "
                        "that order reads them all")
            old = ShardedOrder(like.lengths[:shards], seed=spec["seed"], shuffle=shuffle,
                               block_shards=spec.get("block_shards", BLOCK_SHARDS),
                               algorithm=algorithm)
            if old.spec()["shard_lengths"] != spec.get("shard_lengths"):
                return (f"the lengths of the first {shards} shards changed (only shards "
                        "appended after them keep that order readable)")
        else:
            return (f"the order's kind changed from {kind!r} to {like.spec()['kind']!r}, and "
                    "their samples are not the same")
    except (KeyError, TypeError, ValueError) as e:
        return f"its record is damaged ({e})"
    if old.spec() != spec:
        return f"its record {spec!r} does not describe an order of this version of ckptd"
    return old
