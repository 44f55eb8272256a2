"""Fetching planned ranges: ranged reads in parallel threads within a host-memory budget; every
frame's checksum verified on exactly the bytes read; compressed frames decoded.

Memory: every read buffer comes from (or is counted by) :class:`Buffers`. Before a range is
requested, the buffers it will need are reserved (its stored bytes, plus a decoded buffer per
compressed read and a frame's decoding temporaries), and released once it is done; buffers of up to
``unit_bytes`` are pooled and reused, so a streaming load touches the same few pages over and
over (fresh pages cost ~1 GB/s of page faults on a VM, as much as the disk). ``Buffers.peak``
is the reader's peak host memory for read buffers: allocated bytes, pooled ones included. A
range larger than the whole budget is still read — alone.

Files are read through one :class:`ckptd.storage.base.ReadSession` per load (:class:`StepFiles`):
opened once, sizes known before anything is read. A session that fills buffers (local files)
reads straight into pooled buffers; any other returns its own buffers, which are counted, not
pooled.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptd import config
from ckptd.errors import CorruptCheckpoint
from ckptd.hostarray import HostArray, no_grad
from ckptd.loader.plan import Range, Read, source_view
from ckptd.manifest import codecs
from ckptd.storage import Storage
from ckptd.storage.base import BlockCache, ReadSession

if TYPE_CHECKING:
    import torch

Buf = bytearray | bytes | memoryview


class Buffers:
    """Read buffers: at most ``limit`` bytes reserved at once (``reserve`` blocks while the
    new total would exceed it, unless nothing is reserved), pooled by ``unit``-sized slots."""

    def __init__(self, limit: int, unit: int | None = None) -> None:
        self.limit = max(1, int(limit))
        # the read unit, and the pooled buffer size: at most a quarter of the budget, so that
        # several ranges are in flight even under a small budget
        self.unit = unit or max(4096, min(config.get().unit_bytes, self.limit // 4))
        self.reserved = 0
        self.allocated = 0  # bytes of live buffers, pooled idle ones included
        self.peak = 0
        self._idle: list[bytearray] = []
        self._idle_bytes = 0
        self._cond = threading.Condition()

    def size_of(self, n: int) -> int:
        """Bytes a buffer of ``n`` bytes occupies: a pooled unit from a quarter unit up (the
        bulk of a load), exactly ``n`` below (small ranges are not worth a whole unit)."""
        return self.unit if self.unit // 4 < n <= self.unit else n

    def cost(self, rng: Range) -> int:
        """Bytes to reserve for fetching and decoding ``rng``."""
        out = self.size_of(rng.length)
        for r in rng.reads:
            if r.compressed:  # + a frame's temporaries while it decodes (codecs.decode)
                out += self.size_of(r.raw_length) + 4 * r.chunk.frame_bytes
        return out

    # Invariant: idle pooled bytes <= limit - reserved, and everything in use (buffers and
    # decoding temporaries) is covered by a reservation; so allocations stay within the limit.
    def reserve(self, n: int) -> None:
        with self._cond:
            while self.reserved and self.reserved + n > self.limit:
                self._cond.wait()
            self.reserved += n
            self._trim()

    def release(self, n: int) -> None:
        with self._cond:
            self.reserved -= n
            self._cond.notify_all()

    def take(self, n: int) -> bytearray:
        """A buffer of at least ``n`` bytes (call within a reservation covering it)."""
        size = self.size_of(n)
        with self._cond:
            if size == self.unit and self._idle:
                self._idle_bytes -= size
                return self._idle.pop()
            self._count(size)
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        """Hand back a buffer (before releasing the reservation that covered it)."""
        with self._cond:
            if len(buf) == self.unit:
                self._idle.append(buf)
                self._idle_bytes += len(buf)
                self._trim(len(buf))
            else:
                self.allocated -= len(buf)

    def _trim(self, covered: int = 0) -> None:
        while self._idle and self._idle_bytes > self.limit - self.reserved + covered:
            buf = self._idle.pop()
            self._idle_bytes -= len(buf)
            self.allocated -= len(buf)

    def count(self, n: int) -> None:
        """Account for a buffer allocated elsewhere (a backend's read result)."""
        with self._cond:
            self._count(n)

    def uncount(self, n: int) -> None:
        with self._cond:
            self.allocated -= n

    def _count(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)


@dataclass
class ReadStats:
    ranges: int = 0  # storage requests
    stored_bytes: int = 0  # bytes requested from storage
    frames: int = 0  # frames verified

    def add(self, other: ReadStats) -> None:
        self.ranges += other.ranges
        self.stored_bytes += other.stored_bytes
        self.frames += other.frames


Data = dict[Read, memoryview]  # decoded bytes of each read of a range


def copy_range(rng: Range, data: Data) -> None:
    """Copy every region of ``rng`` into its destination (thread-safe: regions are disjoint).
    The destinations of a plan are all tensors, or all HostArrays (the offline reshard)."""
    first = next((c for r in rng.reads for c in r.copies), None)
    if first is None:
        return
    over: Callable[[memoryview], Any] = (
        HostArray.over if isinstance(first.piece.view, HostArray) else as_uint8)
    with no_grad(first.piece.view):
        for read in rng.reads:
            raw = over(data[read])
            for c in read.copies:
                src = source_view(c, raw, c.piece.dtype)
                c.piece.view[c.region.within(c.piece.box)].copy_(src)


def as_uint8(buf: Buf) -> torch.Tensor:
    """A uint8 tensor over ``buf`` without copying (read-only buffers are only ever read)."""
    import torch

    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we only read it
        return torch.frombuffer(buf, dtype=torch.uint8)


def decode_read(read: Read, stored: memoryview, where: str, out: bytearray | None = None,
                ) -> memoryview:
    """Verify every frame of ``read`` in ``stored`` (its stored bytes) and return the raw bytes:
    a view of ``stored`` for raw chunks, ``out`` (``raw_length`` bytes or more) decoded for
    compressed ones."""
    chunk = read.chunk
    if len(stored) != read.length:
        raise CorruptCheckpoint(
            f"{where}: {read.tensor}: short read ({len(stored)} of {read.length} bytes)")
    if read.compressed and out is None:
        out = bytearray(read.raw_length)
    pos = raw_pos = 0
    table = chunk.table
    for i in range(read.frame_lo, read.frame_hi):
        size = int(table.stored[i])
        data = stored[pos : pos + size]
        pos += size
        if codecs.checksum_int(data) != int(table.checksums[i]):
            raise CorruptCheckpoint(
                f"{where}: {read.tensor}: checksum mismatch in frame {i} of the chunk at byte "
                f"{chunk.offset} (box {chunk.box.to_json()})")
        if read.compressed:
            assert out is not None
            raw_len = min(chunk.frame_bytes, chunk.length - i * chunk.frame_bytes)
            try:
                raw = codecs.decode(data, chunk.codec, raw_len, read.itemsize)
            except Exception as e:  # zstd errors have no common base class
                raise CorruptCheckpoint(
                    f"{where}: {read.tensor}: frame {i} does not decode ({e})") from e
            out[raw_pos : raw_pos + raw_len] = raw
            raw_pos += raw_len
            del raw
    if out is not None:
        return memoryview(out)[: read.raw_length]
    return stored


class StepFiles:
    """The data files of one committed step, opened for one load (or verify, or reshard)."""

    def __init__(self, storage: Storage, step_dir: str, files: Collection[str], *,
                 cache_bytes: int = 0, block_bytes: int = 256 << 10) -> None:
        """``cache_bytes`` > 0: keep recently read blocks (see ``storage.base.BlockCache``)."""
        self.url = storage.url
        self.step_dir = step_dir
        try:
            self.session: ReadSession = storage.open_read(
                [self.path(f) for f in sorted(files)])
        except FileNotFoundError as e:
            raise CorruptCheckpoint(f"{e.filename or self.where('')}: data file missing") from e
        self.cache: BlockCache | None = None
        if cache_bytes > 0:
            self.cache = BlockCache(self.session, block_bytes, cache_bytes)
            self.session = self.cache

    def path(self, file: str) -> str:
        return f"{self.step_dir}/{file}"

    def where(self, file: str) -> str:
        return f"{self.url}/{self.step_dir}/{file}"  # messages name the file as the user knows it

    def size(self, file: str) -> int | None:
        return self.session.sizes.get(self.path(file))

    def check_bounds(self, ranges: Sequence[Range]) -> None:
        """Every range inside its file, before a byte is read or a buffer allocated for it (a
        manifest may claim a 64 GiB frame in a 17 KB file)."""
        for rng in ranges:
            size = self.size(rng.file)
            if size is not None and rng.start + rng.length > size:
                raise CorruptCheckpoint(
                    f"{self.where(rng.file)}: {', '.join(rng.tensors)}: the manifest places "
                    f"{rng.length} bytes at offset {rng.start}, past the end of the "
                    f"{size}-byte file (truncated, or a corrupt frame table)")

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> StepFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Fetched:
    """A fetched range: its decoded bytes per read, and the buffers to hand back."""

    def __init__(self, data: Data, buffers: Buffers, owned: list[bytearray], counted: int):
        self.data, self._buffers, self._owned, self._counted = data, buffers, owned, counted

    def free(self) -> None:
        self.data.clear()
        for b in self._owned:
            self._buffers.give(b)
        self._owned = []
        self._buffers.uncount(self._counted)
        self._counted = 0


def fetch_range(files: StepFiles, rng: Range, buffers: Buffers) -> Fetched:
    """Read, verify and decode one range (within a reservation of ``buffers.cost(rng)``)."""
    path = files.path(rng.file)
    where = files.where(rng.file)
    owned: list[bytearray] = []
    counted = 0
    try:
        if files.session.fills_buffers:
            buf = buffers.take(rng.length)
            owned.append(buf)
            view = memoryview(buf)[: rng.length]
            files.session.read_into(path, rng.start, view)
        else:
            blob = files.session.read(path, rng.start, rng.length)
            counted = len(blob)
            buffers.count(counted)
            view = memoryview(blob)
    except FileNotFoundError as e:
        Fetched({}, buffers, owned, counted).free()
        raise CorruptCheckpoint(f"{where}: {', '.join(rng.tensors)}: data file missing") from e
    except EOFError as e:
        Fetched({}, buffers, owned, counted).free()
        raise CorruptCheckpoint(
            f"{where}: {', '.join(rng.tensors)}: data file truncated ({e})") from e
    got = Fetched({}, buffers, owned, counted)
    try:
        for r in rng.reads:
            out = None
            if r.compressed:
                out = buffers.take(r.raw_length)
                owned.append(out)
            got.data[r] = decode_read(
                r, view[r.start - rng.start : r.start - rng.start + r.length], where, out)
    except BaseException:
        got.free()
        raise
    return got


def run_ranges(
    files: StepFiles,
    ranges: Sequence[Range],
    pool: ThreadPoolExecutor,
    buffers: Buffers,
    use: Callable[[Range, Data], None] | None = None,
    *,
    hold: Collection[int] = (),
    stats: ReadStats | None = None,
) -> dict[int, Fetched]:
    """Fetch ``ranges`` in parallel within ``buffers``' budget, and call ``use(range, data)``
    on each in the worker thread (e.g. copy into the destination).

    Ranges whose index is in ``hold`` keep their data and reservation: they are returned by
    index, and the caller calls ``free()`` and ``buffers.release(buffers.cost(range))`` when
    done. The first error is raised after the ranges in flight finish; no further range starts.
    """
    held: dict[int, Fetched] = {}
    lock = threading.Lock()
    failed: list[BaseException] = []
    local = ReadStats()

    def work(i: int, rng: Range) -> None:
        keep = False
        got = None
        try:
            if failed:
                return
            got = fetch_range(files, rng, buffers)
            with lock:
                local.ranges += 1
                local.stored_bytes += rng.length
                local.frames += sum(r.frame_hi - r.frame_lo for r in rng.reads)
            if use is not None:
                use(rng, got.data)
            if i in hold:
                with lock:
                    held[i] = got
                keep = True
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
            with lock:
                failed.append(e)
        finally:
            if not keep:
                if got is not None:
                    got.free()
                buffers.release(buffers.cost(rng))

    futures: list[Future[None]] = []
    for i, rng in enumerate(ranges):
        if failed:
            break
        buffers.reserve(buffers.cost(rng))
        futures.append(pool.submit(work, i, rng))
    for f in futures:
        f.result()
    if stats is not None:
        stats.add(local)
    if failed:
        for i, got in held.items():  # the caller gets an error, not the data: free it here
            got.free()
            buffers.release(buffers.cost(ranges[i]))
        raise failed[0]
    return held
