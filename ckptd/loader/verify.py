"""``ckptd verify``: re-read every byte of a committed step, check every frame's checksum, the
coverage of every logical tensor, and that overlapping (replicated) copies agree.

Reads go through the same ranges, threads and memory budget as a load; every problem is
reported (a bad range does not stop the others)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ckptd import config
from ckptd.errors import CkptdError
from ckptd.loader.fetch import Buffers, StepFiles, copy_range, fetch_range, run_ranges
from ckptd.loader.plan import Range, Read, coalesce, plan_load
from ckptd.manifest import Chunk, Manifest, TensorEntry, find_hole
from ckptd.regions import Box
from ckptd.sharding import Piece
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


def whole_chunk_reads(name: str, chunk: Chunk, itemsize: int, unit_bytes: int) -> list[Read]:
    """Every frame of ``chunk`` (its frames loaded), in reads of at most ``unit_bytes`` raw
    bytes."""
    assert chunk.frames is not None
    per = max(1, unit_bytes // chunk.frame_bytes)
    ends = chunk.frames.ends()
    out = []
    for a in range(0, len(chunk.frames), per):
        b = min(len(chunk.frames), a + per)
        out.append(Read(name, chunk, itemsize, a, b, chunk.offset + int(ends[a]),
                        int(ends[b] - ends[a])))
    return out


def verify(storage: Storage, step_dir: str, manifest: Manifest, pool: ThreadPoolExecutor,
           progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Re-read every byte of ``manifest``'s step; ``progress(n)`` is called with the bytes of
    each range read (the checksum pass, then each copy read by the agreement pass)."""
    report = VerifyReport()
    unit = Buffers(config.get().load_budget_bytes).unit
    reads: list[Read] = []
    entries = _with_frames(manifest, report)
    for name, entry in entries.items():
        report.tensors += 1
        hole = find_hole(Box.whole(entry.shape), [c.box for c in entry.chunks])
        if hole is not None:
            report.problems.append(f"{name}: not covered at offsets {list(hole.offsets)} "
                                   f"sizes {list(hole.sizes)}")
        for chunk in entry.chunks:
            reads += whole_chunk_reads(name, chunk, entry.itemsize, unit)
    ranges = coalesce(reads, 0, unit)
    try:
        files = StepFiles(storage, step_dir, {r.file for r in ranges})
    except CkptdError as e:  # a file missing, a link, a FIFO, a refused read
        report.problems.append(str(e))
        return report
    with files:
        bad_chunks = _check_ranges(files, ranges, pool, report, progress)
        report.chunks = sum(len(e.chunks) for e in entries.values()) - len(bad_chunks)
        for name, entry in entries.items():
            _check_copies(files, name, entry, bad_chunks, pool, report, progress)
    return report


def _with_frames(manifest: Manifest, report: VerifyReport) -> dict[str, TensorEntry]:
    """Every tensor with its chunks' frames read (all tables at once; when that fails, tensor
    by tensor). A tensor whose chunks or frame table slices are damaged is reported, counted
    and left out; the rest is still verified."""
    groups: dict[str, list[Chunk]] = {}
    for n in sorted(manifest.tensors):
        try:
            groups[n] = list(manifest.tensors[n].chunks)
        except CkptdError as e:
            report.problems.append(str(e))
            report.tensors += 1
    items = [(n, c) for n, cs in groups.items() for c in cs]
    try:
        chunks = manifest.with_frames(items)
        for n in groups:
            groups[n] = []
        for (n, _), c in zip(items, chunks, strict=True):
            groups[n].append(c)
    except CkptdError:
        for n in list(groups):
            try:
                groups[n] = manifest.with_frames([(n, c) for c in groups[n]])
            except CkptdError as e:
                report.problems.append(str(e))
                report.tensors += 1
                del groups[n]
    return {n: TensorEntry(manifest.tensors[n].dtype, manifest.tensors[n].shape, tuple(cs))
            for n, cs in groups.items()}


def _check_ranges(files: StepFiles, ranges: list[Range], pool: ThreadPoolExecutor,
                  report: VerifyReport, progress: Callable[[int], None] | None) -> set[int]:
    buffers = Buffers(config.get().load_budget_bytes)
    lock = threading.Lock()
    bad: set[int] = set()

    def one(rng: Range) -> None:
        try:
            files.check_bounds([rng])
            fetch_range(files, rng, buffers).free()
            with lock:
                report.bytes_read += rng.length
                if progress:
                    progress(rng.length)
        except CkptdError as e:
            with lock:
                report.problems.append(str(e))
                bad.update(id(r.chunk) for r in rng.reads)
        finally:
            buffers.release(buffers.cost(rng))

    futures: list[Future[None]] = []
    for rng in ranges:
        buffers.reserve(buffers.cost(rng))
        futures.append(pool.submit(one, rng))
    for f in futures:
        f.result()
    return bad


def _read_region(files: StepFiles, name: str, entry: TensorEntry, chunks: Sequence[Chunk],
                 region: Box, pool: ThreadPoolExecutor) -> torch.Tensor:
    """``region`` as a load would read it from ``chunks`` (each element from one of them)."""
    out = torch.empty(region.sizes, dtype=entry.dtype)
    only = Manifest(0, "", 1, 0.0,
                    {name: TensorEntry(entry.dtype_name, entry.shape, tuple(chunks))})
    piece = Piece(name, entry.shape, entry.dtype, region, out)
    buffers = Buffers(config.get().load_budget_bytes)
    plan = plan_load(only, [piece], unit_bytes=buffers.unit)
    run_ranges(files, plan.ranges, pool, buffers, copy_range)
    return out


def _overlapping(chunks: Sequence[Chunk]) -> list[Chunk]:
    """The chunks that share elements with another chunk (a sweep along dimension 0)."""
    if len(chunks) < 2:
        return []
    order = sorted(chunks, key=lambda c: c.box.offsets[0] if c.box.offsets else 0)
    hit: set[int] = set()
    active: list[Chunk] = []
    for c in order:
        lo = c.box.offsets[0] if c.box.offsets else 0
        active = [a for a in active if not a.box.offsets or a.box.offsets[0] + a.box.sizes[0] > lo]
        for a in active:
            if a.box.intersect(c.box) is not None:
                hit.update((id(a), id(c)))
        active.append(c)
    return [c for c in chunks if id(c) in hit]


def _check_copies(files: StepFiles, name: str, entry: TensorEntry, bad: set[int],
                  pool: ThreadPoolExecutor, report: VerifyReport,
                  progress: Callable[[int], None] | None) -> None:
    """Every copy of replicated elements against the copies before it, each copy read once:
    per slab (at most a quarter of the load budget along dimension 0) a reference starts empty;
    each copy's part of the slab is read, compared where the reference already holds values,
    and fills in the rest. k copies cost k reads, not k^2."""
    good = [c for c in entry.chunks if id(c) not in bad]
    copies = _overlapping(good)
    if not copies:
        return
    itemsize = entry.itemsize
    whole = Box.whole(entry.shape)
    row = itemsize * (whole.numel // max(1, whole.sizes[0])) if whole.sizes else itemsize
    rows = max(1, config.get().load_budget_bytes // 4 // max(row, 1))
    n0 = whole.sizes[0] if whole.sizes else 1
    for lo in range(0, n0, rows):
        slab = (Box((lo, *whole.offsets[1:]), (min(rows, n0 - lo), *whole.sizes[1:]))
                if whole.sizes else whole)
        parts = [(c, r) for c in copies if (r := c.box.intersect(slab)) is not None]
        if not parts:
            continue
        region = parts[0][1]
        for _, r in parts[1:]:
            region = region.hull(r)
        reference = torch.empty(region.sizes, dtype=entry.dtype)
        held = torch.zeros(region.sizes, dtype=torch.bool)
        for c, r in parts:
            report.overlaps_checked += 1
            mine = _read_region(files, name, entry, [c], r, pool)
            if progress:
                progress(r.numel * itemsize)
            at = r.within(region)
            seen = held[at]
            ref = reference[at]
            if bool(seen.any()):
                bytes_mine = mine.reshape(*mine.shape, 1).view(torch.uint8)
                bytes_ref = ref.reshape(*ref.shape, 1).view(torch.uint8)
                differ = (bytes_mine != bytes_ref).any(dim=-1) & seen
                if bool(differ.any()):
                    first = [int(i) for i in differ.nonzero()[0]]
                    report.problems.append(
                        f"{name}: the copy in {c.file} (rank {c.rank}, box {c.box.to_json()}) "
                        f"disagrees with the other copies; first difference at element "
                        f"{[o + i for o, i in zip(r.offsets, first, strict=True)]}")
            reference[at] = torch.where(seen, ref, mine)
            held[at] = True


__all__ = ["verify", "VerifyReport", "whole_chunk_reads"]
