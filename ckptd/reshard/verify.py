"""``ckptd verify``: re-read every byte of a committed step, check every frame's checksum, the
coverage of every logical tensor, and that overlapping (replicated) copies agree.

Reads go through the same ranges, threads and memory budget as a load; every problem is
reported (a bad range does not stop the others)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ckptd import config
from ckptd.errors import CorruptCheckpoint
from ckptd.manifest import Chunk, Manifest, TensorEntry, find_hole
from ckptd.regions import Box
from ckptd.reshard.load import copy_range
from ckptd.reshard.plan import Range, Read, coalesce, itemsize_of, plan_load
from ckptd.reshard.reader import Buffers, fetch_range, run_ranges
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
    """Every frame of ``chunk``, in reads of at most ``unit_bytes`` raw bytes."""
    per = max(1, unit_bytes // chunk.frame_bytes)
    out, pos = [], chunk.offset
    for a in range(0, len(chunk.frames), per):
        b = min(len(chunk.frames), a + per)
        length = sum(f.stored for f in chunk.frames[a:b])
        out.append(Read(name, chunk, itemsize, a, b, pos, length))
        pos += length
    return out


def verify(storage: Storage, step_dir: str, manifest: Manifest, pool: ThreadPoolExecutor,
           progress: Callable[[int], None] | None = None) -> VerifyReport:
    report = VerifyReport()
    unit = Buffers(config.get().load_budget_bytes).unit
    reads: list[Read] = []
    for name, entry in sorted(manifest.tensors.items()):
        report.tensors += 1
        hole = find_hole(Box.whole(entry.shape), [c.box for c in entry.chunks])
        if hole is not None:
            report.problems.append(f"{name}: not covered at offsets {list(hole.offsets)} "
                                   f"sizes {list(hole.sizes)}")
        for chunk in entry.chunks:
            reads += whole_chunk_reads(name, chunk, itemsize_of(entry.dtype), unit)
    ranges = coalesce(reads, 0, unit)
    bad_chunks = _check_ranges(storage, step_dir, ranges, pool, report, progress)
    report.chunks = sum(len(e.chunks) for e in manifest.tensors.values()) - len(bad_chunks)
    for name, entry in sorted(manifest.tensors.items()):
        _check_overlaps(storage, step_dir, name, entry, bad_chunks, pool, report)
    return report


def _check_ranges(storage: Storage, step_dir: str, ranges: list[Range], pool: ThreadPoolExecutor,
                  report: VerifyReport, progress: Callable[[int], None] | None) -> set[int]:
    buffers = Buffers(config.get().load_budget_bytes)
    lock = threading.Lock()
    bad: set[int] = set()

    def one(rng: Range) -> None:
        try:
            fetch_range(storage, step_dir, rng, buffers).free()
            with lock:
                report.bytes_read += rng.length
                if progress:
                    progress(rng.length)
        except CorruptCheckpoint as e:
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


def _chunk_values(storage: Storage, step_dir: str, name: str, entry: TensorEntry, chunk: Chunk,
                  region: Box, pool: ThreadPoolExecutor) -> torch.Tensor:
    """``region`` as stored in ``chunk`` alone."""
    out = torch.empty(region.sizes, dtype=entry.dtype)
    only = Manifest(0, "", 1, 0.0, {name: TensorEntry(entry.dtype, entry.shape, (chunk,))})
    piece = Piece(name, entry.shape, entry.dtype, region, out)
    buffers = Buffers(config.get().load_budget_bytes)
    plan = plan_load(only, [piece], unit_bytes=buffers.unit)
    run_ranges(storage, step_dir, plan.ranges, pool, buffers, copy_range)
    return out


def _check_overlaps(storage: Storage, step_dir: str, name: str, entry: TensorEntry,
                    bad: set[int], pool: ThreadPoolExecutor, report: VerifyReport) -> None:
    chunks = entry.chunks
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            inter = a.box.intersect(b.box)
            if inter is None or id(a) in bad or id(b) in bad:
                continue
            report.overlaps_checked += 1
            va = _chunk_values(storage, step_dir, name, entry, a, inter, pool)
            vb = _chunk_values(storage, step_dir, name, entry, b, inter, pool)
            if not torch.equal(va.reshape(-1).view(torch.uint8), vb.reshape(-1).view(torch.uint8)):
                report.problems.append(
                    f"{name}: copies in {a.file} (rank {a.rank}) and {b.file} (rank {b.rank})"
                    f" disagree at offsets {list(inter.offsets)} sizes {list(inter.sizes)}")


__all__ = ["verify", "VerifyReport", "whole_chunk_reads"]
