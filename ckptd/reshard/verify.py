"""``ckptd verify``: re-read every byte of a committed step, check every frame's checksum, the
coverage of every logical tensor, and that overlapping (replicated) copies agree."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import Manifest, find_hole
from ckptd.regions import Box
from ckptd.reshard.plan import Read, source_view
from ckptd.reshard.reader import fetch
from ckptd.storage import Storage


@dataclass
class VerifyReport:
    tensors: int = 0
    chunks: int = 0
    bytes_read: int = 0
    overlaps_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _whole_read(name: str, m: Manifest, ci: int) -> Read:
    entry = m.tensors[name]
    chunk = entry.chunks[ci]
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    return Read(name, chunk, itemsize, 0, len(chunk.frames), chunk.offset,
                sum(f.stored for f in chunk.frames))


def verify(storage: Storage, step_dir: str, manifest: Manifest, pool: ThreadPoolExecutor,
           progress: Callable[[int], None] | None = None) -> VerifyReport:
    report = VerifyReport()
    for name, entry in sorted(manifest.tensors.items()):
        report.tensors += 1
        hole = find_hole(Box.whole(entry.shape), [c.box for c in entry.chunks])
        if hole is not None:
            report.problems.append(f"{name}: not covered at offsets {list(hole.offsets)} "
                                   f"sizes {list(hole.sizes)}")
        overlapping = {
            i for i, a in enumerate(entry.chunks) for j, b in enumerate(entry.chunks)
            if i != j and a.box.intersect(b.box) is not None
        }
        kept: dict[int, torch.Tensor] = {}
        for ci in range(len(entry.chunks)):
            read = _whole_read(name, manifest, ci)
            try:
                data = fetch(storage, step_dir, [read], pool)[id(read)]
            except CorruptCheckpoint as e:
                report.problems.append(str(e))
                continue
            report.chunks += 1
            report.bytes_read += read.length
            if progress:
                progress(read.length)
            if ci in overlapping:
                kept[ci] = data.view(entry.dtype).view(entry.chunks[ci].box.sizes) \
                    if entry.chunks[ci].box.numel else data
        for i in sorted(kept):
            for j in sorted(kept):
                if j <= i:
                    continue
                a, b = entry.chunks[i], entry.chunks[j]
                inter = a.box.intersect(b.box)
                if inter is None:
                    continue
                report.overlaps_checked += 1
                va = kept[i][inter.within(a.box)]
                vb = kept[j][inter.within(b.box)]
                if not torch.equal(va.view(torch.uint8) if va.dim() else va,
                                   vb.view(torch.uint8) if vb.dim() else vb):
                    report.problems.append(
                        f"{name}: copies in {a.file} (rank {a.rank}) and {b.file} (rank {b.rank})"
                        f" disagree at offsets {list(inter.offsets)} sizes {list(inter.sizes)}"
                    )
    return report


__all__ = ["verify", "VerifyReport", "source_view"]
