"""The offline reshard: rewrite a committed checkpoint so that its data is packed per rank of a
planned target world (``ckptd reshard CKPT --to-world N``).

Which boxes each target rank holds comes from a layout (:mod:`ckptd.reshard.targets`), not from
model code. Each target rank's pieces are written into its own data files, back to back in
(name, box) order, which is also the order its load reads them: a restart then reads one
contiguous range per file instead of a slice of every saved chunk. A box held by several target
ranks is written by each of them when it is small (``replicate_small_bytes``: norms, biases) and
the extra copies stay within ``replicate_max_share`` (1 %) of the checkpoint's bytes; otherwise
once, by the least-loaded holder. Bytes written are at most 1.01 x the checkpoint's.

Durability: the target ranks' files and partials are written without an fsync each and flushed
together before the commit (``Storage.deferred_durability``: one ``syncfs`` on a local root).

Work and memory: target ranks are processed by ``workers`` threads; each fills an arena of at
most ``budget / (2 * workers)`` bytes (a rank with more data takes several rounds, one file
each) by reading the source through the load planner (coalesced ranges, parallel reads, frames
verified) under a shared read budget of ``budget / 2``, then writes it with
:class:`ckptd.writer.pipeline.RankWriter` (a fixed attempt id; its partial manifest per rank).
The commit merges the partials (coverage and agreement checks of ``manifest.merge``), keeps the
per-rank copies of replicated boxes, carries the source's values, per-rank values and training
metadata (re-planned for the new world, :mod:`ckptd.elastic.reshard`), and writes
``manifest.json`` atomically, then ``latest``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd import config
from ckptd.errors import CkptdError
from ckptd.manifest import Chunk, Manifest, TensorEntry, codecs, layout, merge
from ckptd.reshard import direct
from ckptd.reshard.load import gap_bytes, make_plan
from ckptd.reshard.reader import Buffers, ReadStats, StepFiles
from ckptd.reshard.targets import Assignment, Target
from ckptd.sharding import Piece
from ckptd.storage import Storage
from ckptd.storage.base import extended
from ckptd.writer import commit
from ckptd.writer.pipeline import RankWriter, Share, plan_rounds
from ckptd.writer.staging import StagingPool


@dataclass
class RankPlan:
    rank: int
    holds: list[Target]
    writes: list[Target]

    @property
    def hold_bytes(self) -> int:
        return sum(t.nbytes for t in self.holds)

    @property
    def write_bytes(self) -> int:
        return sum(t.nbytes for t in self.writes)


@dataclass
class RankReport:
    rank: int
    pieces: int
    hold_bytes: int
    write_bytes: int
    read_bytes: int = 0  # stored bytes the reshard reads from the source for this rank
    ranges: int = 0  # ... in this many requests
    peak_bytes: int = 0  # host memory for this rank's arena and its reads
    restart_ranges: int = 0  # requests a restart on the original checkpoint would make
    restart_bytes: int = 0

    def to_json(self) -> dict[str, int]:
        return dict(vars(self))


def split_writers(assignment: Assignment, replicate_small: int,
                  max_share: float | None = None) -> list[RankPlan]:
    """Who writes what: unique boxes by their holder; replicated ones (the same box on several
    ranks) by every holder when small and while the extra copies stay within ``max_share`` of
    the distinct bytes (smallest first), else once, by the holder with the fewest bytes so far.
    So the bytes written are at most ``1 + max_share`` times the checkpoint's."""
    if max_share is None:
        max_share = config.get().replicate_max_share
    holders: dict[tuple[str, Any], list[int]] = {}
    target: dict[tuple[str, Any], Target] = {}
    for r, targets in enumerate(assignment.ranks):
        for t in targets:
            k = (t.name, t.box)
            rs = holders.setdefault(k, [])
            if not rs or rs[-1] != r:
                rs.append(r)
            target[k] = t
    writes: list[list[Target]] = [[] for _ in assignment.ranks]
    load = [0] * len(assignment.ranks)
    shared = []
    room = max_share * sum(t.nbytes for t in target.values())  # bytes of extra copies allowed
    for k in sorted(holders, key=lambda k: (target[k].nbytes, k[0], k[1].offsets)):
        t, rs = target[k], holders[k]
        extra = (len(rs) - 1) * t.nbytes
        if len(rs) == 1 or (t.nbytes <= replicate_small and extra <= room):
            room -= extra
            for r in rs:
                writes[r].append(t)
                load[r] += t.nbytes
        else:
            shared.append(k)
    for k in sorted(shared, key=lambda k: (-target[k].nbytes, k[0], k[1].offsets)):
        owner = min(holders[k], key=lambda r: (load[r], r))
        writes[owner].append(target[k])
        load[owner] += target[k].nbytes
    order = {k: i for i, k in enumerate(holders)}  # the assignment's (name, box) order
    for w in writes:
        w.sort(key=lambda t: order[(t.name, t.box)])
    return [RankPlan(r, holds, writes[r]) for r, holds in enumerate(assignment.ranks)]


def meta_pieces(targets: list[Target]) -> list[Piece]:
    return [Piece(t.name, t.shape, t.dtype, t.box, torch.empty(t.box.sizes, dtype=t.dtype,
                                                               device="meta"))
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
            n: TensorEntry(e.dtype, e.shape, tuple(next(loaded) for _ in e.chunks))
            for n, e in m.tensors.items()})
        self.plans = split_writers(self.assignment, self.replicate_small)
        self.workers = max(1, min(self.threads, len(self.plans)))
        self.arena_budget = max(1, self.budget // (2 * self.workers))
        self.src_dir = layout.step_dir(self.step)

    # ---------------------------------------------------------------- dry run
    def dry_run(self) -> list[RankReport]:
        out = []
        reads = Buffers(self.budget // 2)
        for p in self.plans:
            rep = RankReport(p.rank, len(p.holds), p.hold_bytes, p.write_bytes)
            rounds = plan_rounds(meta_pieces(p.writes), 1, self.arena_budget, tight=True)
            for rnd in rounds:
                plan = make_plan(self.source, self.manifest, _slot_pieces(rnd.plans), None,
                                 reads)
                rep.read_bytes += plan.stored_bytes
                rep.ranges += len(plan.ranges)
                costs = sorted((reads.cost(r) for r in plan.ranges), reverse=True)
                in_flight = min(sum(costs[: self.threads]), reads.limit)
                rep.peak_bytes = max(rep.peak_bytes, rnd.nbytes + in_flight)
            restart = make_plan(self.source, self.manifest, meta_pieces(p.holds), p.rank,
                                Buffers(self.budget))
            rep.restart_ranges, rep.restart_bytes = len(restart.ranges), restart.stored_bytes
            out.append(rep)
            if self.on_bytes:
                self.on_bytes(p.write_bytes)
        return out

    # ---------------------------------------------------------------- run
    def run(self, training: dict[str, Any]) -> tuple[Manifest, list[RankReport]]:
        dest = self.dest
        if dest is None:
            raise CkptdError("reshard: no destination")
        if dest.exists(layout.manifest_path(self.step)):
            raise CkptdError(f"{dest.url}/{layout.step_dir(self.step)}: already committed; choose "
                             "another --out")
        run_id = f"reshard{uuid.uuid4().hex[:8]}"
        attempt = f"{run_id}-000001"
        codec, level = output_codec(self.manifest, self.compression)
        read_budget = Buffers(self.budget // 2)
        partials: list[Manifest | None] = [None] * len(self.plans)
        reports: list[RankReport | None] = [None] * len(self.plans)
        commit.claim(dest, run_id)
        # The source's files, opened once for every target rank, with a block cache: target
        # ranks that each hold a thin slice of every tensor read the same frames, and would
        # otherwise fetch them once each (an FSDP2 checkpoint at --to-world 256: 67x the bytes).
        files = StepFiles(self.source, self.src_dir,
                          {c.file for e in self.manifest.tensors.values() for c in e.chunks},
                          cache_bytes=min(self.budget // 4, 256 << 20),
                          block_bytes=config.get().min_frame_bytes)
        # nothing is visible before the commit: the files and partials of every target rank are
        # made durable together, before it (one filesystem sync, not three fsyncs per rank)
        with extended(dest).deferred_durability(), files, \
                ThreadPoolExecutor(self.threads, thread_name_prefix="ckptd-reshard-io") as io, \
                ThreadPoolExecutor(self.workers, thread_name_prefix="ckptd-reshard") as workers:
            local = threading.local()

            def one(p: RankPlan) -> None:
                if not hasattr(local, "writer"):
                    local.writer = RankWriter(dest, io, StagingPool(1, pin=False), codec, level)
                partials[p.rank], reports[p.rank] = self._write_rank(
                    p, local.writer, attempt, io, read_budget, files)

            try:
                for f in [workers.submit(one, p) for p in self.plans]:
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
        written = [p for p in partials if p is not None]
        merged = merge(written)
        every: dict[str, list[Chunk]] = {name: [] for name in merged.tensors}
        for p in written:  # keep every rank's copy (merge keeps one): one pass over the partials
            for name, entry in p.tensors.items():
                every[name] += entry.chunks
        tensors = {name: TensorEntry(e.dtype, e.shape, tuple(every[name]))
                   for name, e in merged.tensors.items()}
        m = self.manifest
        out = Manifest(m.step, attempt, len(self.plans), time.time(), tensors, dict(m.values),
                       {k: dict(v) for k, v in m.locals.items()}, training)
        commit.commit(dest, out, run_id)
        return out, [r for r in reports if r is not None]

    def _write_rank(self, p: RankPlan, writer: RankWriter, attempt: str, io: ThreadPoolExecutor,
                    read_budget: Buffers, files: StepFiles) -> tuple[Manifest, RankReport]:
        declared = {t.name: TensorEntry(t.dtype, t.shape) for t in p.holds}
        if p.rank == 0:  # every tensor declared somewhere, even one with no elements
            declared = {n: TensorEntry(e.dtype, e.shape) for n, e in self.manifest.tensors.items()}
        share = Share(self.step, attempt, p.rank, len(self.plans), declared,
                      values=dict(self.manifest.values) if p.rank == 0 else {})
        rep = RankReport(p.rank, len(p.holds), p.hold_bytes, p.write_bytes)
        rounds = plan_rounds(meta_pieces(p.writes), 1, self.arena_budget, tight=True)
        chunks = []
        index = 0
        for rnd in rounds:
            arena = writer.pool.acquire(rnd.nbytes)
            try:
                pieces = _slot_pieces(rnd.plans, arena.buffer)
                plan = make_plan(self.source, self.manifest, pieces, None, read_budget)
                stats = ReadStats()
                before = read_budget.peak
                files.check_bounds(plan.ranges)
                direct.fill(files, self.manifest, plan.ranges, None, io,
                            read_budget, gap_bytes(self.source), read_budget.unit, stats)
                rep.read_bytes += stats.stored_bytes
                rep.ranges += stats.ranges
                rep.peak_bytes = max(rep.peak_bytes, rnd.nbytes + max(before, read_budget.peak))
                chunks += writer.write_round(share, arena, rnd, index)
            finally:
                writer.pool.release(arena)
            index += len(rnd.plans)
            if self.on_bytes:
                self.on_bytes(sum(s.nbytes for fp in rnd.plans for s in fp.slots))
        return writer.write_partial(share, chunks), rep


def _slot_pieces(plans: list[Any], arena: torch.Tensor | None = None) -> list[Piece]:
    """The pieces of a round's file plans, viewing the arena at their slots (meta without one)."""
    out = []
    for fp in plans:
        for s in fp.slots:
            q = s.piece
            if arena is None:
                view = q.view
            else:
                view = arena[s.offset : s.offset + s.nbytes].view(q.dtype).view(q.box.sizes)
            out.append(Piece(q.name, q.global_shape, q.dtype, q.box, view))
    return out
