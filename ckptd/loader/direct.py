"""Reading straight into the destination: the copy pass of a local load, and the offline
reshard's reads into its arenas.

When a region of a raw (uncompressed) chunk is one run of the file and its destination is one
run of CPU memory, the whole frames inside it are read with ``preadv`` directly into the
destination, and their checksums are verified there — on exactly the bytes read, as everywhere
else. This saves the copy out of a read buffer (a load's copy pass then costs one memcpy from
the page cache per byte). The partial frames at the ends, compressed chunks, strided or GPU
destinations and other backends go through the buffered reader.

In a load this runs only after every rank verified every frame (the verify pass), so a
mismatch here means the files changed in between: the error says that the destination is then
partially loaded.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptd.errors import CorruptCheckpoint
from ckptd.hostarray import flat_bytes
from ckptd.loader.fetch import Buffers, ReadStats, StepFiles, copy_range, run_ranges
from ckptd.loader.plan import Copy, Range, plan_load
from ckptd.manifest import Chunk, Manifest, codecs
from ckptd.regions import flat_run, flat_to_boxes
from ckptd.sharding import Piece


@dataclass(eq=False)
class DirectRead:
    """Frames ``[frame_lo, frame_hi)`` of a raw chunk, read into ``dest`` (uint8, contiguous; a
    tensor or a HostArray)."""

    tensor: str
    chunk: Chunk
    frame_lo: int
    frame_hi: int
    dest: Any

    @property
    def start(self) -> int:
        return self.chunk.offset + self.frame_lo * self.chunk.frame_bytes


def _sub_pieces(c: Copy, lo: int, hi: int) -> list[Piece]:
    """The destination pieces of flat elements ``[lo, hi)`` of the copy's chunk."""
    p, chunk = c.piece, c.chunk
    out = []
    for bx in flat_to_boxes(chunk.box.sizes, lo, hi):
        g = bx.shift(chunk.box.offsets)
        out.append(Piece(p.name, p.global_shape, p.dtype, g, p.view[g.within(p.box)]))
    return out


def split(ranges: list[Range], unit_bytes: int) -> tuple[list[DirectRead], list[Piece]]:
    """The direct reads of ``ranges``' copies, and the pieces left for the buffered reader."""
    direct: list[DirectRead] = []
    rest: list[Piece] = []
    for rng in ranges:
        for read in rng.reads:
            for c in read.copies:
                d = _direct(c, unit_bytes)
                if d is None:
                    p = c.piece
                    rest.append(Piece(p.name, p.global_shape, p.dtype, c.region,
                                      p.view[c.region.within(p.box)]))
                else:
                    direct += d[0]
                    rest += d[1]
    return direct, rest


def _direct(c: Copy, unit_bytes: int) -> tuple[list[DirectRead], list[Piece]] | None:
    chunk, isz = c.chunk, c.itemsize
    if chunk.codec != codecs.RAW or c.piece.view.device.type != "cpu":
        return None
    run = flat_run(c.region, chunk.box)
    dst = c.piece.view[c.region.within(c.piece.box)]
    if run is None or not dst.is_contiguous() or dst.dim() == 0:
        return None
    lo, hi = run
    fb = chunk.frame_bytes
    f0 = -(-lo * isz // fb)
    f1 = chunk.n_frames if hi * isz == chunk.length else hi * isz // fb
    if f0 >= f1:
        return None
    flat = flat_bytes(dst)
    reads = []
    per = max(1, unit_bytes // fb)
    for a in range(f0, f1, per):
        b = min(f1, a + per)
        start = a * fb - lo * isz
        end = min(b * fb, chunk.length) - lo * isz
        reads.append(DirectRead(c.tensor, chunk, a, b, flat[start:end]))
    rest = []
    if f0 * fb > lo * isz:
        rest += _sub_pieces(c, lo, f0 * fb // isz)
    if f1 < chunk.n_frames and f1 * fb < hi * isz:
        rest += _sub_pieces(c, f1 * fb // isz, hi)
    return reads, rest


def _read_one(files: StepFiles, d: DirectRead) -> None:
    where = files.where(d.chunk.file)
    mem = memoryview(d.dest.numpy()).cast("B")  # type: ignore[arg-type]
    try:
        files.session.read_into(files.path(d.chunk.file), d.start, mem)
    except FileNotFoundError as e:
        raise CorruptCheckpoint(f"{where}: {d.tensor}: data file missing") from e
    except EOFError as e:
        raise CorruptCheckpoint(f"{where}: {d.tensor}: data file truncated ({e})") from e
    pos = 0
    table = d.chunk.table
    for i in range(d.frame_lo, d.frame_hi):
        size = int(table.stored[i])
        if codecs.checksum_int(mem[pos : pos + size]) != int(table.checksums[i]):
            raise CorruptCheckpoint(
                f"{where}: {d.tensor}: checksum mismatch in frame {i} of the chunk at byte "
                f"{d.chunk.offset} (box {d.chunk.box.to_json()}); it was verified before: the "
                "checkpoint changed during the load, whose destination is partially written")
        pos += size


def fill(files: StepFiles, manifest: Manifest, ranges: list[Range],
         rank: int | None, pool: ThreadPoolExecutor, buffers: Buffers, gap_bytes: int,
         unit_bytes: int, stats: ReadStats | None = None) -> None:
    """Read ``ranges`` into their destinations: directly where the session reads into the
    caller's memory (local files), through ``buffers`` otherwise (the pieces left over are
    planned again, for their frames)."""
    direct, rest = split(ranges, unit_bytes) if files.session.fills_buffers else ([], [])
    if not direct:  # nothing to read directly: the planned ranges as they are
        run_ranges(files, ranges, pool, buffers, copy_range, stats=stats)
        return
    lock = threading.Lock()
    failed: list[BaseException] = []
    local = ReadStats()

    def one(d: DirectRead) -> None:
        if failed:
            return
        try:
            _read_one(files, d)
            with lock:
                local.ranges += 1
                local.stored_bytes += d.dest.numel()
                local.frames += d.frame_hi - d.frame_lo
        except BaseException as e:  # noqa: BLE001 - re-raised below
            with lock:
                failed.append(e)

    futures: list[Future[None]] = [pool.submit(one, d) for d in direct]
    plan = plan_load(manifest, rest, rank=rank, gap_bytes=gap_bytes, unit_bytes=unit_bytes)
    try:
        run_ranges(files, plan.ranges, pool, buffers, copy_range, stats=stats)
    finally:
        for f in futures:
            f.result()
    if stats is not None:
        stats.add(local)
    if failed:
        raise failed[0]
