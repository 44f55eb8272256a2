"""Read planning: which bytes of which saved chunks each destination piece needs.

For every destination piece, the saved chunks of its logical tensor are taken in manifest order
and each contributes the part of the piece not yet covered by an earlier chunk, so every element
is read from exactly one copy even where replicated chunks overlap. The needed bytes of a chunk
are rounded out to whole frames (the unit that is checksummed and decodable), and the frame
intervals of one chunk are merged so a frame is fetched and verified once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ckptd.manifest import Chunk, Manifest
from ckptd.regions import Box
from ckptd.sharding import Piece


@dataclass
class Read:
    """Frames ``[frame_lo, frame_hi)`` of one chunk; ``start``/``length`` are the stored bytes
    in ``chunk.file``."""

    tensor: str
    chunk: Chunk
    itemsize: int
    frame_lo: int
    frame_hi: int
    start: int = 0
    length: int = 0

    @property
    def raw_start(self) -> int:
        return self.frame_lo * self.chunk.frame_bytes

    @property
    def raw_length(self) -> int:
        return min(self.frame_hi * self.chunk.frame_bytes, self.chunk.length) - self.raw_start


@dataclass
class Copy:
    piece: Piece
    region: Box
    read: Read


@dataclass
class ReadPlan:
    reads: list[Read] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)

    @property
    def stored_bytes(self) -> int:
        return sum(r.length for r in self.reads)

    @property
    def needed_bytes(self) -> int:
        return sum(c.region.numel * c.read.itemsize for c in self.copies)


def row_major_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def flat_span(region: Box, within: Box) -> tuple[int, int]:
    """First and one-past-last row-major index (in ``within``) of ``region``'s elements."""
    strides = row_major_strides(within.sizes)
    lo = sum((o - wo) * s for o, wo, s in zip(region.offsets, within.offsets, strides, strict=True))
    hi = sum(
        (o + n - 1 - wo) * s
        for o, n, wo, s in zip(region.offsets, region.sizes, within.offsets, strides, strict=True)
    )
    return lo, hi + 1


def plan_reads(manifest: Manifest, pieces: list[Piece]) -> ReadPlan:
    needs: dict[tuple[str, int], list[tuple[Piece, Box, int, int]]] = {}
    for piece in pieces:
        entry = manifest.tensors[piece.name]
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        remaining = [piece.box] if piece.box.numel else []
        for ci, chunk in enumerate(entry.chunks):
            if not remaining:
                break
            nxt: list[Box] = []
            for r in remaining:
                inter = r.intersect(chunk.box)
                if inter is None:
                    nxt.append(r)
                    continue
                lo, hi = flat_span(inter, chunk.box)
                f_lo = lo * itemsize // chunk.frame_bytes
                f_hi = -(-hi * itemsize // chunk.frame_bytes)
                needs.setdefault((piece.name, ci), []).append((piece, inter, f_lo, f_hi))
                nxt.extend(r.subtract(inter))
            remaining = nxt
    plan = ReadPlan()
    for (name, ci), items in needs.items():
        chunk = manifest.tensors[name].chunks[ci]
        itemsize = torch.empty((), dtype=manifest.tensors[name].dtype).element_size()
        prefix = [0]
        for f in chunk.frames:
            prefix.append(prefix[-1] + f.stored)
        merged: list[Read] = []
        for piece, inter, f_lo, f_hi in sorted(items, key=lambda x: x[2]):
            if merged and f_lo <= merged[-1].frame_hi:
                merged[-1].frame_hi = max(merged[-1].frame_hi, f_hi)
            else:
                merged.append(Read(name, chunk, itemsize, f_lo, f_hi))
            plan.copies.append(Copy(piece, inter, merged[-1]))
        for r in merged:
            r.start = chunk.offset + prefix[r.frame_lo]
            r.length = prefix[r.frame_hi] - prefix[r.frame_lo]
        plan.reads.extend(merged)
    return plan


def source_view(read: Read, raw: torch.Tensor, region: Box) -> torch.Tensor:
    """A view of ``region`` inside the decoded bytes of ``read`` (no copy)."""
    chunk = read.chunk
    strides = row_major_strides(chunk.box.sizes)
    first, _ = flat_span(region, chunk.box)
    base = read.raw_start // read.itemsize
    return raw.as_strided(region.sizes, strides, first - base)
