"""Regions of logical tensors in global coordinates, and copying between them.

A region is an n-d :class:`Box` (offsets + sizes). A flat range of the row-major flattening (what
a ZeRO flat buffer holds) is decomposed by :func:`flat_to_boxes` into at most ``2 * ndim - 1``
boxes, each of which is itself contiguous in the flattening — so a flat piece of a local buffer
can be viewed box by box without copying, and everything downstream only deals with boxes.

Nothing here does I/O or allocates a tensor: copies go view to view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Box:
    """``offsets[i] <= index[i] < offsets[i] + sizes[i]`` in every dimension ``i``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    # offsets + sizes and the element count, computed once: planners ask for them in every
    # overlap test, reshard plans for every piece
    ends: tuple[int, ...] = field(init=False, repr=False, compare=False)
    numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box rank mismatch: offsets {self.offsets}, sizes {self.sizes}")
        if self.sizes and (min(self.sizes) < 0 or min(self.offsets) < 0):
            raise ValueError(f"negative box: offsets {self.offsets}, sizes {self.sizes}")
        object.__setattr__(self, "ends", tuple(o + s for o, s in zip(
            self.offsets, self.sizes, strict=True)))
        object.__setattr__(self, "numel", math.prod(self.sizes))

    @staticmethod
    def _of(offsets: tuple[int, ...], sizes: tuple[int, ...], ends: tuple[int, ...]) -> Box:
        """A box computed from valid boxes (an intersection, a shift): no checks. A reshard
        to a thousand ranks makes hundreds of thousands of them."""
        box = object.__new__(Box)
        object.__setattr__(box, "offsets", offsets)
        object.__setattr__(box, "sizes", sizes)
        object.__setattr__(box, "ends", ends)
        object.__setattr__(box, "numel", math.prod(sizes))
        return box

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Box:
        sizes = tuple(shape)
        if sizes and min(sizes) < 0:
            raise ValueError(f"negative box: sizes {sizes}")
        return Box._of((0,) * len(sizes), sizes, sizes)

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common box, or None when they do not overlap (or the overlap is empty)."""
        if other.ndim != self.ndim:
            raise ValueError(f"intersecting boxes of rank {self.ndim} and {other.ndim}")
        lo, hi = [], []
        for a, ae, b, be in zip(self.offsets, self.ends, other.offsets, other.ends, strict=True):
            low, high = max(a, b), min(ae, be)
            if high <= low:
                return None
            lo.append(low)
            hi.append(high)
        return Box._of(tuple(lo), tuple(h - low for low, h in zip(lo, hi, strict=True)),
                       tuple(hi))

    def hull(self, other: Box) -> Box:
        """The smallest box containing both."""
        lo = tuple(min(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(max(a, b) for a, b in zip(self.ends, other.ends, strict=True))
        return Box._of(lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)), hi)

    def contains(self, other: Box) -> bool:
        return all(
            so <= oo and oe <= se
            for so, se, oo, oe in zip(
                self.offsets, self.ends, other.offsets, other.ends, strict=True
            )
        )

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside a tensor holding exactly ``outer`` (which must contain it)."""
        return tuple(
            slice(o - oo, o - oo + s)
            for o, s, oo in zip(self.offsets, self.sizes, outer.offsets, strict=True)
        )

    def subtract(self, other: Box) -> list[Box]:
        """``self`` minus ``other`` as disjoint boxes (at most ``2 * ndim``)."""
        inter = self.intersect(other)
        if inter is None:
            return [self] if self.numel else []
        out: list[Box] = []
        offsets, sizes = list(self.offsets), list(self.sizes)
        for d in range(self.ndim):
            lo, hi = inter.offsets[d], inter.ends[d]
            if lo > offsets[d]:
                s = sizes.copy()
                s[d] = lo - offsets[d]
                out.append(Box._of(tuple(offsets), tuple(s),
                                   tuple(o + n for o, n in zip(offsets, s, strict=True))))
            end = offsets[d] + sizes[d]
            if hi < end:
                o = offsets.copy()
                o[d] = hi
                s = sizes.copy()
                s[d] = end - hi
                out.append(Box._of(tuple(o), tuple(s),
                                   tuple(a + n for a, n in zip(o, s, strict=True))))
            offsets[d], sizes[d] = lo, hi - lo
        return out

    def shift(self, by: tuple[int, ...]) -> Box:
        """This box moved by ``by`` (non-negative offsets stay non-negative only if ``by`` is)."""
        if min(by, default=0) < 0:
            return Box(tuple(o + b for o, b in zip(self.offsets, by, strict=True)), self.sizes)
        return Box._of(tuple(o + b for o, b in zip(self.offsets, by, strict=True)), self.sizes,
                       tuple(e + b for e, b in zip(self.ends, by, strict=True)))

    def to_json(self) -> list[list[int]]:
        return [list(self.offsets), list(self.sizes)]

    @staticmethod
    def from_json(raw: object) -> Box:
        if not (isinstance(raw, list) and len(raw) == 2):
            raise ValueError(f"a box is [offsets, sizes], got {raw!r}")
        offsets, sizes = raw
        if not (isinstance(offsets, list) and isinstance(sizes, list)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in offsets + sizes
        ):
            raise ValueError(f"a box is [offsets, sizes] of integers, got {raw!r}")
        return Box(tuple(offsets), tuple(sizes))


def flat_to_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Decompose the flat range ``[start, stop)`` of ``shape``'s row-major flattening into boxes.

    The boxes come in flattening order and each is contiguous in it, so the ``k``-th box's
    elements are exactly the flat elements ``[start + sum(numel of boxes before k), ...)``.
    """
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of {total} elements")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    rest = shape[1:]

    def in_row(row: int, a: int, b: int) -> list[Box]:
        return [Box((row, *bx.offsets), (1, *bx.sizes)) for bx in flat_to_boxes(rest, a, b)]

    first = start // inner
    if first == (stop - 1) // inner:  # inside one row
        return in_row(first, start - first * inner, stop - first * inner)
    last = stop // inner
    out: list[Box] = []
    if start % inner:
        out += in_row(first, start % inner, inner)
        first += 1
    if last > first:
        out.append(Box((first,) + (0,) * len(rest), (last - first, *rest)))
    if stop % inner:
        out += in_row(last, 0, stop % inner)
    return out


def row_major_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def flat_run(region: Box, within: Box) -> tuple[int, int] | None:
    """``[lo, hi)`` flat indices of ``region`` in ``within``'s row-major flattening if it is one
    run there, else None (the inverse of :func:`flat_to_boxes` for one box)."""
    local = [o - w for o, w in zip(region.offsets, within.offsets, strict=True)]
    partial = [d for d in range(region.ndim) if region.sizes[d] != within.sizes[d]]
    # one run: every dim after the first partial one is whole, every dim before it has size 1
    if partial and any(region.sizes[d] != 1 for d in range(partial[0])):
        return None
    if partial and any(d > partial[0] for d in partial):
        return None
    strides = row_major_strides(within.sizes)
    lo = sum(o * s for o, s in zip(local, strides, strict=True))
    return lo, lo + region.numel


def copy_region(
    region: Box, src: torch.Tensor, src_box: Box, dst: torch.Tensor, dst_box: Box
) -> None:
    """Copy ``region`` from ``src`` (holding ``src_box``) into ``dst`` (holding ``dst_box``).

    Both tensors are indexed through views: nothing but the region's elements moves.
    """
    dst[region.within(dst_box)].copy_(src[region.within(src_box)])
