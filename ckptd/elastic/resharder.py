"""The offline reshard: rewrite a committed checkpoint so that its data is packed per rank of a
planned target world (``ckptd reshard CKPT --to-world N``).

Which boxes each target rank holds comes from a layout (:mod:`ckptd.loader.targets`), not from
model code. Each target rank's pieces are written into its own data files, back to back in
(name, box) order, which is also the order its load reads them: a restart then reads one
contiguous range per file instead of a slice of every saved chunk. A box held by several target
ranks is written once, as a save writes it (one chunk every holder reads, not one per target
rank: Adam's 0-d ``step`` would be 1,024 chunks at ``--to-world 1024``): a small one
(``replicate_small_bytes``) by its first holder, a larger one by the least-loaded holder. With
``replicate_max_share`` > 0 the small ones are written by every holder while the extra copies
stay within that share of the checkpoint's bytes. Bytes written are at most (1 + that share) x
the checkpoint's. A world several times the source's is taken in groups of that many
consecutive ranks: a small tensor's boxes that the ranks of a group hold one after another
(row-major: FSDP2's dim-0 shards, ZeRO-3's flat slices) are a few chunks, written by the first
holder and framed at the ranks' boundaries (:func:`ckptd.elastic.writers.coalesce`), so the
output has about the source's number of chunks and a rank still reads its own frames.

Reading: target ranks with little data each are read in *waves* (:mod:`ckptd.elastic.waves`):
the source regions of a run of consecutive ranks are read once, through the load planner
(coalesced ranges, parallel reads, frames verified), and each rank's pieces are views of them,
so the cost follows the bytes and the number of tensors, not the number of target ranks. A rank
with more than its arena's bound is read alone, round by round, straight into its arena.

Work and memory: ``workers`` threads write the target ranks, each with an arena of at most
``budget / (2 * workers)`` bytes (a rank with more data takes several rounds, one file each),
with :class:`ckptd.writer.pipeline.RankWriter` (a fixed attempt id); at most two waves of
``budget / 16`` bytes are held at once; reads share ``budget / 8`` of buffers (compressed
sources; raw frames are read into place) and a block cache of ``budget / 32`` (at most 16 MiB)
keeps the frames at the edges of consecutive ranks and waves from being fetched twice.

Durability and the commit: files are written without an fsync each and the directories are
walked once (``Storage.deferred_durability``), then flushed together before the commit (one
``syncfs`` on a local root). The target ranks' partial manifests are merged in this process and
never written (their frame tables are): the commit merges them (coverage and agreement checks
of ``manifest.merge``), keeps the per-rank copies of replicated boxes (when
``replicate_max_share`` asked for them), carries the source's
values, per-rank values and training metadata (re-planned for the new world,
:mod:`ckptd.elastic.reshard`), and writes ``manifest.json`` atomically, then ``latest``. A
reshard killed before its commit leaves only data files of an attempt no manifest names.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptd import catalog, config
from ckptd.elastic import waves
from ckptd.elastic.writers import RankPlan, split_writers
from ckptd.errors import CkptdError
from ckptd.hostarray import HostArray
from ckptd.loader import direct
from ckptd.loader.fetch import Buffers, ReadStats, StepFiles
from ckptd.loader.load import gap_bytes, make_plan
from ckptd.loader.targets import Assignment, Target
from ckptd.manifest import Chunk, Manifest, TensorEntry, codecs, layout
from ckptd.sharding import Piece
from ckptd.storage import Storage
from ckptd.writer import commit
from ckptd.writer.pipeline import RankWriter, Share, plan_rounds, runs_within
from ckptd.writer.staging import StagingPool

if TYPE_CHECKING:
    import torch


@dataclass
class RankReport:
    rank: int
    pieces: int
    hold_bytes: int
    write_bytes: int
    # stored bytes the reshard reads from the source for this rank, in this many requests; a
    # wave's (ranks read together) shared out over its ranks in proportion to their writes
    read_bytes: int = 0
    ranges: int = 0
    wave: int = -1  # the first rank of the wave it was read with (itself when read alone)
    peak_bytes: int = 0  # host memory for this rank's arena and its reads
    restart_ranges: int = 0  # requests a restart on the original checkpoint would make
    restart_bytes: int = 0

    def to_json(self) -> dict[str, int]:
        return dict(vars(self))


def meta_pieces(targets: list[Target]) -> list[Piece]:
    return [Piece(t.name, t.shape, t.dtype, t.box, HostArray.meta(t.box.sizes, t.dtype),
                  frame_bytes=t.frame_bytes)
            for t in targets]


def output_codec(manifest: Manifest, compression: str | None) -> tuple[str, int]:
    """``"same"``/None: zstd (byte planes, level 3) if the source has compressed chunks."""
    if compression in (None, "same"):
        used = {c.codec for e in manifest.tensors.values() for c in e.chunks}
        return (codecs.ZSTD_PLANES, 3) if used - {codecs.RAW} else (codecs.RAW, 0)
    return codecs.parse_compression(compression)


@dataclass
class Resharder:
    source: Storage
    step: int
    manifest: Manifest
    assignment: Assignment
    budget: int
    threads: int
    replicate_small: int
    dest: Storage | None = None
    compression: str | None = None
    on_bytes: Callable[[int], None] | None = None
    plans: list[RankPlan] = field(init=False)
    source_bytes_read: int = 0  # by run(): bytes fetched from the source's storage

    def __post_init__(self) -> None:
        # every target rank plans reads of the same source chunks: their frame tables are read
        # and checked once here, not once per target rank
        m = self.manifest
        loaded = iter(m.with_frames([(n, c) for n, e in m.tensors.items() for c in e.chunks]))
        self.manifest = dataclasses.replace(m, tensors={
            n: TensorEntry(e.dtype_name, e.shape, tuple(next(loaded) for _ in e.chunks))
            for n, e in m.tensors.items()})
        self.workers = max(1, min(self.threads, len(self.assignment.ranks)))
        self.arena_budget = max(1, self.budget // (2 * self.workers))
        # a world several times the source's: a group of that many consecutive ranks writes
        # each small tensor's boxes as a few chunks, so the output has about the source's
        # number of chunks (its manifest about the source's size), not one per rank; a run of
        # boxes is at most 16 frames of the save's size and a quarter of a worker's arena
        self.group = max(1, len(self.assignment.ranks) // max(1, m.world_size))
        below = config.get().frame_bytes
        self.plans = split_writers(self.assignment, self.replicate_small, group=self.group,
                                   coalesce_below=below,
                                   coalesce_max=min(16 * below, self.arena_budget // 4))
        self.src_dir = layout.step_dir(self.step)
        # consecutive ranks are read in waves of budget / 16 (a larger rank is a wave of its
        # own); at most two waves' regions are held at a time (one being written, the next read)
        self.waves = runs_within([p.write_bytes for p in self.plans], max(1, self.budget // 16))

    # ---------------------------------------------------------------- dry run
    def dry_run(self) -> list[RankReport]:
        out = []
        reads = Buffers(self.budget // 8)
        for wave in self.waves:
            plans = [self.plans[r] for r in wave]
            reps = [_report(p, plans[0].rank) for p in plans]
            if len(plans) == 1:
                rounds = plan_rounds(meta_pieces(plans[0].writes), 1, self.arena_budget,
                                     tight=True)
                for rnd in rounds:
                    read = ReadStats()
                    peak = self._dry_read(_slot_pieces(rnd.plans), reads, read)
                    reps[0].read_bytes += read.stored_bytes
                    reps[0].ranges += read.ranges
                    reps[0].peak_bytes = max(reps[0].peak_bytes, rnd.nbytes + peak)
            else:
                regions = waves.Regions.of([t for p in plans for t in p.writes], meta=True)
                read = ReadStats()
                peak = self._dry_read(regions.pieces(), reads, read)
                _share_reads(reps, read, regions.nbytes + peak)
            for p, rep in zip(plans, reps, strict=True):
                restart = make_plan(self.source, self.manifest, meta_pieces(p.holds), p.rank,
                                    Buffers(self.budget))
                rep.restart_ranges, rep.restart_bytes = len(restart.ranges), restart.stored_bytes
                out.append(rep)
                if self.on_bytes:
                    self.on_bytes(p.write_bytes)
        return out

    def _dry_read(self, pieces: list[Piece], reads: Buffers, into: ReadStats) -> int:
        """What reading ``pieces`` would fetch (into ``into``); the read buffers it would hold."""
        plan = make_plan(self.source, self.manifest, pieces, None, reads)
        into.stored_bytes += plan.stored_bytes
        into.ranges += len(plan.ranges)
        costs = sorted((reads.cost(r) for r in plan.ranges), reverse=True)
        return min(sum(costs[: self.threads]), reads.limit)

    # ---------------------------------------------------------------- run
    def run(self, training: dict[str, Any]) -> tuple[Manifest, list[RankReport]]:
        dest = self.dest
        if dest is None:
            raise CkptdError("reshard: no destination")
        owner = catalog.read_owner(dest)
        if owner is not None:  # taking it over would make the job writing there fail
            raise CkptdError(
                f"{dest.url}: a ckptd root owned by run {owner.run} already; reshard into a "
                "new root (--out), then point the job at it")
        run_id = f"reshard{uuid.uuid4().hex[:8]}"
        attempt = f"{run_id}-000001"
        codec, level = output_codec(self.manifest, self.compression)
        read_budget = Buffers(self.budget // 8)
        partials: list[Manifest | None] = [None] * len(self.plans)
        reports: list[RankReport | None] = [None] * len(self.plans)
        generation = commit.claim(dest, run_id)
        # The source's files, opened once for every target rank, with a block cache for the
        # frames that consecutive ranks and waves share at their edges.
        files = StepFiles(self.source, self.src_dir,
                          {c.file for e in self.manifest.tensors.values() for c in e.chunks},
                          cache_bytes=min(self.budget // 32, 16 << 20),
                          block_bytes=config.get().min_frame_bytes)
        # nothing is visible before the commit: the files of every target rank are made durable
        # together, before it (one filesystem sync, not two fsyncs per rank)
        with dest.deferred_durability(), files, \
                ThreadPoolExecutor(self.threads, thread_name_prefix="ckptd-reshard-io") as io, \
                ThreadPoolExecutor(self.workers, thread_name_prefix="ckptd-reshard") as workers:
            local = threading.local()

            def writer() -> RankWriter:  # one per worker thread
                if not hasattr(local, "writer"):
                    local.writer = RankWriter(
                        dest, io, StagingPool(1, pin=False, allocate=HostArray.bytes), codec, level)
                return local.writer  # type: ignore[no-any-return]

            def one(p: RankPlan) -> None:
                partials[p.rank], reports[p.rank] = self._write_rank(
                    p, writer(), attempt, io, read_budget, files)

            def wave_rank(p: RankPlan, regions: waves.Regions, rep: RankReport,
                          done: _WaveDone) -> None:
                written = self._write_from(p, writer(), attempt, regions, rep)
                reports[p.rank] = rep
                complete = done.add(p.rank, written)
                if complete is not None:  # the wave's last rank: one frame table for them all
                    for (share, _), m in zip(complete, writer().partials(complete), strict=True):
                        partials[share.rank] = m

            futures: list[list[Future[None]]] = []
            try:
                for wave in self.waves:
                    plans = [self.plans[r] for r in wave]
                    if len(plans) == 1:
                        futures.append([workers.submit(one, plans[0])])
                        continue
                    if len(futures) >= 2:  # two waves' regions at most: the previous one's
                        for f in futures[-2]:  # and this one's
                            f.result()
                    regions = waves.Regions.of([t for p in plans for t in p.writes])
                    reps = [_report(p, plans[0].rank) for p in plans]
                    read = self._read(regions.pieces(), files, io, read_budget)
                    _share_reads(reps, read, regions.nbytes + read_budget.peak)
                    done = _WaveDone([p.rank for p in plans])
                    futures.append([workers.submit(wave_rank, p, regions, rep, done)
                                    for p, rep in zip(plans, reps, strict=True)])
                for fs in futures:
                    for f in fs:
                        f.result()
            except BaseException:
                for path in (f"{layout.step_dir(self.step)}/data/{attempt}",
                             layout.partials_dir(self.step, attempt)):
                    try:  # best effort: an abandoned attempt is also what `ckptd gc` removes
                        dest.remove(path)
                    except OSError:
                        pass
                raise
            assert files.cache is not None
            self.source_bytes_read = files.cache.fetched
        m = self.manifest
        # with replicate_max_share > 0, every holder's copy of a small replicated box is kept:
        # each reads its own
        out = commit.commit_partials(
            dest, [p for p in partials if p is not None], run_id, generation=generation,
            keep_copies=True, values=dict(m.values),
            locals={k: dict(v) for k, v in m.locals.items()}, training=training,
            tuples=m.tuples)
        return out, [r for r in reports if r is not None]

    def _share(self, p: RankPlan, attempt: str) -> Share:
        declared = {t.name: TensorEntry(t.dtype, t.shape) for t in p.holds}
        if p.rank == 0:  # every tensor declared somewhere, even one with no elements
            declared = {n: TensorEntry(e.dtype_name, e.shape)
                        for n, e in self.manifest.tensors.items()}
        return Share(self.step, attempt, p.rank, len(self.plans), declared,
                     values=dict(self.manifest.values) if p.rank == 0 else {},
                     tuples=self.manifest.tuples if p.rank == 0 else frozenset())

    def _read(self, pieces: list[Piece], files: StepFiles, io: ThreadPoolExecutor,
              read_budget: Buffers) -> ReadStats:
        """Fill ``pieces`` from the source: planned, bounds checked, frames verified."""
        plan = make_plan(self.source, self.manifest, pieces, None, read_budget)
        stats = ReadStats()
        files.check_bounds(plan.ranges)
        direct.fill(files, self.manifest, plan.ranges, None, io, read_budget,
                    gap_bytes(self.source), read_budget.unit, stats)
        return stats

    def _write_rank(self, p: RankPlan, writer: RankWriter, attempt: str, io: ThreadPoolExecutor,
                    read_budget: Buffers, files: StepFiles) -> tuple[Manifest, RankReport]:
        """A rank of its own: each round read straight into its arena, then written."""
        share = self._share(p, attempt)
        rep = _report(p, p.rank)
        rounds = plan_rounds(meta_pieces(p.writes), 1, self.arena_budget, tight=True)
        chunks = []
        index = 0
        for rnd in rounds:
            arena = writer.pool.acquire(rnd.nbytes)
            try:
                before = read_budget.peak
                stats = self._read(_slot_pieces(rnd.plans, arena.buffer), files, io,
                                   read_budget)
                rep.read_bytes += stats.stored_bytes
                rep.ranges += stats.ranges
                rep.peak_bytes = max(rep.peak_bytes, rnd.nbytes + max(before, read_budget.peak))
                chunks += writer.write_round(share, arena, rnd, index)
            finally:
                writer.pool.release(arena)
            index += len(rnd.plans)
            if self.on_bytes:
                self.on_bytes(sum(s.nbytes for fp in rnd.plans for s in fp.slots))
        return writer.partial(share, chunks), rep

    def _write_from(self, p: RankPlan, writer: RankWriter, attempt: str,
                    regions: waves.Regions, rep: RankReport) -> Written:
        """A rank of a wave: its pieces view the wave's regions, staged like a save's; its
        partial is made with the wave's (one frame table)."""
        share = self._share(p, attempt)
        rounds = plan_rounds([regions.piece(t) for t in p.writes], 1, self.arena_budget,
                             tight=True)
        chunks = writer.write_rounds(share, rounds)
        rep.peak_bytes += sum(r.nbytes for r in rounds)
        if self.on_bytes:
            self.on_bytes(p.write_bytes)
        return share, chunks


Written = tuple[Share, list[tuple[str, Chunk]]]  # a rank's share and the chunks it wrote


class _WaveDone:
    """Collects the ranks of a wave as they finish; the last one gets them all, in order."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks, self.done, self.lock = ranks, dict[int, Written](), threading.Lock()

    def add(self, rank: int, written: Written) -> list[Written] | None:
        with self.lock:
            self.done[rank] = written
            if len(self.done) < len(self.ranks):
                return None
        return [self.done[r] for r in self.ranks]


def _report(p: RankPlan, wave: int) -> RankReport:
    return RankReport(p.rank, len(p.holds), p.hold_bytes, p.write_bytes, wave=wave)


def _share_reads(reps: list[RankReport], read: ReadStats, peak: int) -> None:
    """A wave's reads, shared out over its ranks in proportion to their writes (cumulative
    rounding: the totals are the wave's); each rank's peak memory is the wave's so far."""
    total = sum(r.write_bytes for r in reps) or 1
    done = 0
    given = [0, 0]
    for r in reps:
        done += r.write_bytes
        nbytes, ranges = read.stored_bytes * done // total, read.ranges * done // total
        r.read_bytes, r.ranges = nbytes - given[0], ranges - given[1]
        given = [nbytes, ranges]
        r.peak_bytes = peak


def _slot_pieces(plans: list[Any], arena: HostArray | torch.Tensor | None = None,
                 ) -> list[Piece]:
    """The pieces of a round's file plans, viewing the arena at their slots (meta without one)."""
    out = []
    for fp in plans:
        for s in fp.slots:
            q = s.piece
            if arena is None:
                view = q.view
            else:
                view = arena[s.offset : s.offset + s.nbytes].view(q.dtype).view(q.box.sizes)
            out.append(Piece(q.name, q.global_shape, q.dtype, q.box, view,
                             frame_bytes=q.frame_bytes))
    return out
