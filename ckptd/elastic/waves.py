"""Waves: target ranks of an offline reshard that are read together.

A reshard to a large world gives each target rank a thin slice of many tensors (an FSDP2
checkpoint at ``--to-world 1024``: 1/1024 of the rows of every tensor, ~80 KiB per rank). Read
rank by rank, each of the ~50,000 slices costs a plan, a read and a checksum of the frames
around it, and the cost grows with the number of target ranks, not with the bytes. A *wave* is a
run of consecutive target ranks whose pieces together fit a memory bound: the source regions they
cover are read once for the whole wave (per tensor, the hull of the wave's boxes when it is no
larger than the boxes together, which is the case for slices of a split dimension; else every
distinct box), and each rank's pieces are views of those regions, staged into its arena by the
writer like any save. The cost per wave is one plan over ~one piece per tensor.

Waves are consecutive ranks under the bound (``writer.pipeline.runs_within``, as a save's
rounds). A rank whose pieces are larger than the bound is a wave of its own: it is read straight
into its arena, round by round (no extra copy), which is what matters when each rank has
gigabytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptd import dtypes
from ckptd.hostarray import HostArray
from ckptd.loader.targets import Target
from ckptd.regions import Box
from ckptd.sharding import Piece


@dataclass
class Regions:
    """The source regions of one wave, per tensor, each with the tensor that will hold it."""

    by_name: dict[str, dict[Box, HostArray]]  # one region (the hull), or one per box
    shapes: dict[str, tuple[int, ...]]  # global shapes

    @staticmethod
    def of(targets: Sequence[Target], meta: bool = False) -> Regions:
        """Empty buffers for the regions covering ``targets`` (their bytes are at most the
        targets' distinct bytes); ``meta``: without memory, for a plan."""
        boxes: dict[str, dict[Box, Target]] = {}
        for t in targets:
            if t.box.numel:
                boxes.setdefault(t.name, {})[t.box] = t
        chosen: list[tuple[str, str, Box]] = []
        for name, distinct in boxes.items():
            dtype = next(iter(distinct.values())).dtype
            lo = tuple(map(min, zip(*(b.offsets for b in distinct), strict=True)))
            hi = tuple(map(max, zip(*(b.ends for b in distinct), strict=True)))
            hull = Box(lo, tuple(h - o for o, h in zip(lo, hi, strict=True)))
            chosen += [(name, dtype, b) for b in ([hull] if hull.numel <= sum(
                b.numel for b in distinct) else distinct)]
        out: dict[str, dict[Box, HostArray]] = {}
        if meta:
            for name, dtype, b in chosen:
                out.setdefault(name, {})[b] = HostArray.meta(b.sizes, dtype)
            return Regions(out, {t.name: t.shape for t in targets})
        # one allocation for the wave (given back whole when it is done), regions aligned to 64
        at, offsets = 0, []
        for _, dtype, b in chosen:
            offsets.append(at)
            at += -(-b.numel * dtypes.ITEMSIZE[dtype] // 64) * 64
        arena = HostArray.bytes(at)
        for (name, dtype, b), o in zip(chosen, offsets, strict=True):
            view = arena[o : o + b.numel * dtypes.ITEMSIZE[dtype]].view(dtype).view(b.sizes)
            out.setdefault(name, {})[b] = view
        return Regions(out, {t.name: t.shape for t in targets})

    def pieces(self) -> list[Piece]:
        """The regions as destination pieces of a load plan."""
        return [Piece(name, self.shapes[name], buf.dtype, box, buf)
                for name, regions in self.by_name.items() for box, buf in regions.items()]

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size()
                   for regions in self.by_name.values() for buf in regions.values())

    def piece(self, t: Target) -> Piece:
        """``t`` as a piece viewing the region that holds it."""
        if not t.box.numel:
            view = HostArray.empty(t.box.sizes, t.dtype)
        else:
            regions = self.by_name[t.name]
            if len(regions) == 1:  # the hull
                box, buf = next(iter(regions.items()))
            else:
                box, buf = t.box, regions[t.box]
            view = buf
            for d, (o, n, a, m) in enumerate(zip(t.box.offsets, t.box.sizes, box.offsets,
                                                 box.sizes, strict=True)):
                if n != m:  # narrow per cut dimension: cheaper than indexing by slices
                    view = view.narrow(d, o - a, n)
        return Piece(t.name, t.shape, t.dtype, t.box, view, frame_bytes=t.frame_bytes)
