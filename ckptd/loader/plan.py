"""Read planning: which bytes of which saved chunks the destination pieces need, and how to
fetch them in few, large, parallel requests.

1. **Overlaps.** For every destination piece, the saved chunks of its logical tensor are taken in
   order — chunks written by the same rank number first (a checkpoint packed for this world by
   ``ckptd reshard`` keeps a copy of small replicated tensors in every rank's file), then
   manifest order — and each contributes the part of the piece not yet covered, so every
   element is read from exactly one copy even where replicated chunks overlap.
2. **Frames.** A chunk is stored in frames (the unit that is checksummed and, compressed,
   decodable), so the needed elements are rounded out to the frames they touch
   (:func:`frame_intervals`: a column slice of a chunk with rows longer than a frame skips the
   frames between its runs). The frame intervals of a chunk are merged, and cut into *reads* of
   at most ``unit_bytes`` raw bytes, so no single buffer exceeds the unit.
3. **Copies.** Each read holds a flat range of the chunk, which is at most ``2·ndim − 1`` boxes,
   each contiguous (:func:`ckptd.regions.flat_to_boxes`); a copy is the intersection of one
   such box with a destination piece, so it is a strided view of the read's bytes.
4. **Ranges.** Reads of one file are sorted by offset and coalesced into *ranges* (one storage
   request each) when they are adjacent or separated by at most ``gap_bytes``, up to
   ``unit_bytes`` per range. Ranges are what the reader fetches in parallel threads.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptd.manifest import Chunk, Manifest, codecs
from ckptd.regions import Box, flat_to_boxes, row_major_strides
from ckptd.sharding import Piece

if TYPE_CHECKING:
    import torch

# Above this many separate runs a region's frames are taken as its whole span (planning cost
# stays bounded; only pathological shapes get there, and then the span is nearly dense).
MAX_RUNS = 1 << 16


@dataclass(eq=False)
class Read:
    """Frames ``[frame_lo, frame_hi)`` of one chunk: stored bytes ``[start, start + length)`` of
    ``chunk.file``, raw bytes ``[raw_start, raw_start + raw_length)`` of the chunk."""

    tensor: str
    chunk: Chunk
    itemsize: int
    frame_lo: int
    frame_hi: int
    start: int
    length: int
    copies: list[Copy] = field(default_factory=list)

    @property
    def raw_start(self) -> int:
        return self.frame_lo * self.chunk.frame_bytes

    @property
    def raw_length(self) -> int:
        return min(self.frame_hi * self.chunk.frame_bytes, self.chunk.length) - self.raw_start

    @property
    def compressed(self) -> bool:
        return self.chunk.codec != codecs.RAW


@dataclass(eq=False)
class Copy:
    """``region`` of ``piece`` comes from its read's decoded bytes, where ``box`` (containing
    ``region``) starts ``offset`` elements in, row-major. It names the read's tensor, chunk and
    itemsize rather than the read, so that a plan holds no reference cycle (its destinations
    are freed as soon as the plan is dropped, not at the next garbage collection)."""

    piece: Piece
    region: Box
    tensor: str
    chunk: Chunk
    itemsize: int
    box: Box
    offset: int


@dataclass(eq=False)
class Range:
    """One storage request: ``[start, start + length)`` of ``file``, covering ``reads``."""

    file: str
    start: int
    length: int
    reads: list[Read]

    @property
    def copies(self) -> list[Copy]:
        return [c for r in self.reads for c in r.copies]

    @property
    def tensors(self) -> list[str]:
        return sorted({r.tensor for r in self.reads})


@dataclass
class LoadPlan:
    ranges: list[Range] = field(default_factory=list)
    needed_bytes: int = 0  # bytes of the destination regions

    @property
    def stored_bytes(self) -> int:
        """Bytes requested from storage (frames rounding and coalesced gaps included)."""
        return sum(r.length for r in self.ranges)

    @property
    def reads(self) -> list[Read]:
        return [r for rg in self.ranges for r in rg.reads]

    def runs(self, gap_bytes: int = 0) -> int:
        """Contiguous byte runs (within ``gap_bytes``) that the ranges form, file by file."""
        out, end, file = 0, -1, None
        for rg in self.ranges:  # sorted by file, then offset
            if rg.file != file or rg.start - end > gap_bytes:
                out += 1
            file, end = rg.file, rg.start + rg.length
        return out

    def summary(self) -> dict[str, int]:
        return {"needed_bytes": self.needed_bytes, "stored_bytes": self.stored_bytes,
                "ranges": len(self.ranges), "reads": len(self.reads),
                "files": len({rg.file for rg in self.ranges}),
                "largest_range": max((rg.length for rg in self.ranges), default=0)}


def frame_intervals(region: Box, within: Box, itemsize: int, frame_bytes: int,
                    ) -> list[tuple[int, int]]:
    """Merged ``[lo, hi)`` intervals of the frames of a chunk holding ``within`` that contain
    at least one element of ``region`` (which ``within`` must contain).

    The region's elements form runs in the chunk's row-major order. Going outwards from the
    innermost dimension, a level whose gaps between consecutive sub-spans are all shorter than
    a frame touches every frame of its span (no frame fits in a gap); the spans of the first
    level that is not dense are enumerated — each is separated from the next by at least a
    frame, so there are no more of them than frames.
    """
    if region.numel == 0:
        return []
    strides = row_major_strides(within.sizes)
    local = [o - wo for o, wo in zip(region.offsets, within.offsets, strict=True)]
    sizes = region.sizes
    n = len(sizes)
    extent = 1  # elements from the first to one past the last element of a level-d span
    level = n
    for d in range(n - 1, -1, -1):
        gap = strides[d] - extent
        if sizes[d] > 1 and gap * itemsize >= frame_bytes:
            break
        extent = (sizes[d] - 1) * strides[d] + extent
        level = d
    base = sum(o * s for o, s in zip(local, strides, strict=True))
    outer = sizes[:level]
    if math.prod(outer) > MAX_RUNS:
        starts: Sequence[int] = [base]
        extent = 1 + sum((s - 1) * st for s, st in zip(sizes, strides, strict=True))
    else:
        starts = [base + sum(i * s for i, s in zip(idx, strides, strict=False))
                  for idx in itertools.product(*(range(s) for s in outer))]
    out: list[tuple[int, int]] = []
    for s in starts:
        lo = s * itemsize // frame_bytes
        hi = -(-(s + extent) * itemsize // frame_bytes)
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def chunk_order(chunks: Sequence[Chunk], rank: int | None) -> list[int]:
    """Chunk indices, those written by ``rank`` first (stable)."""
    idx = list(range(len(chunks)))
    if rank is None:
        return idx
    return sorted(idx, key=lambda i: chunks[i].rank != rank)


class ChunkIndex:
    """The chunks of one tensor in :func:`chunk_order`, with their boxes as arrays: the chunks
    overlapping a box are found by one vectorised comparison, not a Python loop over every
    chunk (a target rank of a reshard to a thousand ranks asks this for every tensor)."""

    SMALL = 16  # fewer chunks than this: a plain loop is cheaper than numpy

    def __init__(self, chunks: Sequence[Chunk], rank: int | None) -> None:
        self.order = chunk_order(chunks, rank)
        self.boxes = [chunks[i].box for i in self.order]
        self.lo: np.ndarray | None = None
        self.hi: np.ndarray | None = None
        if len(self.order) >= self.SMALL and self.boxes[0].ndim:
            self.lo = np.array([b.offsets for b in self.boxes], dtype=np.int64)
            self.hi = np.array([b.ends for b in self.boxes], dtype=np.int64)

    def overlapping(self, box: Box) -> list[int]:
        """Indices of the chunks whose box meets ``box`` (non-empty overlap), in order."""
        if not box.numel:
            return []
        if self.lo is None or self.hi is None:
            qlo, qhi = box.offsets, box.ends
            if not qlo:
                return list(self.order)
            lo0, hi0 = qlo[0], qhi[0]  # most chunks miss in the first dimension (dim-0 shards)
            return [ci for ci, b in zip(self.order, self.boxes, strict=True)
                    if b.offsets[0] < hi0 and lo0 < b.ends[0]
                    and all(max(a, c) < min(e, f) for a, e, c, f in zip(
                        b.offsets, b.ends, qlo, qhi, strict=True))]
        hit = ((self.lo < np.array(box.ends)) & (self.hi > np.array(box.offsets))
               & (self.hi > self.lo)).all(axis=1)
        return [self.order[i] for i in np.flatnonzero(hit)]


def plan_load(manifest: Manifest, pieces: Sequence[Piece], *, rank: int | None = None,
              gap_bytes: int = 0, unit_bytes: int = 8 << 20) -> LoadPlan:
    """The reads and copies that fill ``pieces`` from ``manifest`` (see the module docstring).

    Pieces must name tensors of the manifest with its shapes and dtypes (``load.check``)."""
    needs: dict[tuple[str, int], list[tuple[Piece, Box]]] = {}
    plan = LoadPlan()
    indexes: dict[str, ChunkIndex] = {}
    manifest.prefetch(p.name for p in pieces)  # their entries in few reads (format 5)
    for piece in pieces:
        entry = manifest.tensors[piece.name]
        index = indexes.get(piece.name)
        if index is None:
            index = indexes[piece.name] = ChunkIndex(entry.chunks, rank)
        remaining = [piece.box] if piece.box.numel else []
        for ci in index.overlapping(piece.box):
            if not remaining:
                break
            box = entry.chunks[ci].box
            nxt: list[Box] = []
            for r in remaining:
                inter = r.intersect(box)
                if inter is None:
                    nxt.append(r)
                    continue
                needs.setdefault((piece.name, ci), []).append((piece, inter))
                nxt.extend(r.subtract(inter))
            remaining = nxt
    reads: list[Read] = []
    keys = list(needs)
    chunks = manifest.with_frames([(n, manifest.tensors[n].chunks[ci]) for n, ci in keys])
    for (name, _ci), chunk in zip(keys, chunks, strict=True):
        items = needs[(name, _ci)]
        entry = manifest.tensors[name]
        reads += _chunk_reads(name, chunk, entry.itemsize, items, unit_bytes)
        plan.needed_bytes += sum(inter.numel for _, inter in items) * entry.itemsize
    plan.ranges = coalesce(reads, gap_bytes, unit_bytes)
    return plan


def _chunk_reads(name: str, chunk: Chunk, itemsize: int, items: list[tuple[Piece, Box]],
                 unit_bytes: int) -> list[Read]:
    """The reads of one chunk (at most ``unit_bytes`` raw each), with their copies."""
    fb = chunk.frame_bytes
    intervals = merge_intervals([iv for _, inter in items
                                 for iv in frame_intervals(inter, chunk.box, itemsize, fb)])
    per = max(1, unit_bytes // fb)
    assert chunk.frames is not None
    prefix = chunk.frames.ends()
    reads: list[Read] = []
    for lo, hi in intervals:
        for a in range(lo, hi, per):
            b = min(hi, a + per)
            reads.append(Read(name, chunk, itemsize, a, b, chunk.offset + int(prefix[a]),
                              int(prefix[b] - prefix[a])))
    for read in reads:
        first = read.raw_start // itemsize
        boxes, cursor = [], 0
        for bx in flat_to_boxes(chunk.box.sizes, first, first + read.raw_length // itemsize):
            boxes.append((bx.shift(chunk.box.offsets), cursor))
            cursor += bx.numel
        for piece, inter in items:
            for g, offset in boxes:
                region = inter.intersect(g)
                if region is not None and region.numel:
                    read.copies.append(
                        Copy(piece, region, read.tensor, chunk, itemsize, g, offset))
    return reads


def coalesce(reads: list[Read], gap_bytes: int, unit_bytes: int) -> list[Range]:
    """Ranges per file: reads sorted by offset, merged while the gap is at most ``gap_bytes``
    and the range stays within ``unit_bytes`` (a single larger read is a range of its own)."""
    by_file: dict[str, list[Read]] = {}
    for r in reads:
        by_file.setdefault(r.chunk.file, []).append(r)
    out: list[Range] = []
    for file in sorted(by_file, key=_natural):
        current: Range | None = None
        for r in sorted(by_file[file], key=lambda r: r.start):
            end = r.start + r.length
            if (current is not None and r.start - (current.start + current.length) <= gap_bytes
                    and max(end, current.start + current.length) - current.start <= unit_bytes):
                current.length = max(end, current.start + current.length) - current.start
                current.reads.append(r)
            else:
                current = Range(file, r.start, r.length, [r])
                out.append(current)
    return out


def _natural(s: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def source_view(copy: Copy, raw: Any, dtype: torch.dtype | str) -> Any:
    """A view of ``copy.region`` inside the read's decoded bytes ``raw`` (uint8, a tensor or a
    :class:`~ckptd.hostarray.HostArray` like the destination; no copy)."""
    n = copy.box.numel * copy.itemsize
    start = copy.offset * copy.itemsize
    block = raw[start : start + n]
    if block.storage_offset() % copy.itemsize:  # misaligned for a dtype view: realign
        block = block.clone()
    return block.view(dtype).view(copy.box.sizes)[copy.region.within(copy.box)]
