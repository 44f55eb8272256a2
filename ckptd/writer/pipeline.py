"""One rank's share of a save: pack its writer pieces, stage them, write files, write the
partial manifest. Used by the Checkpointer (in the background) and by offline tools that write
checkpoints (``ckptd reshard``, importers).

Host-memory budget: the pieces are cut into *rounds* whose staged size fits the budget (a piece
larger than the budget is split along its first dimension). One round — the normal case — is
staged in the caller's thread and written in the background. Several rounds cannot all be held
at once, so each is staged and written before the next is staged: the save then blocks the
caller until the data is durable (logged as a warning), and only the commit runs in the
background.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptd import config
from ckptd.errors import CkptdError, CorruptCheckpoint
from ckptd.hostarray import HostArray, no_grad
from ckptd.manifest import Chunk, FrameRef, Manifest, TensorEntry, layout
from ckptd.manifest.frames import table_file
from ckptd.manifest.schema import ReplicaSet, names_digest
from ckptd.regions import Box
from ckptd.sharding import Piece
from ckptd.storage import Storage
from ckptd.writer import own_partials
from ckptd.writer.files import ChunkList, Framing, gather, write_file
from ckptd.writer.memcopy import copy_all
from ckptd.writer.pack import PIECE_ALIGN, FilePlan, pack
from ckptd.writer.staging import Arena, StagingPool, copy_into

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ckptd")


@dataclass
class Share:
    """What one rank contributes to one save attempt, besides its data."""

    step: int
    attempt: str
    rank: int
    world_size: int
    declared: dict[str, TensorEntry]
    values: dict[str, Any] = field(default_factory=dict)
    locals: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    tuples: frozenset[str] = frozenset()  # paths of tuples whose elements are in ``values``
    # the declared tensors this rank holds one of several copies of: name -> copies
    # (``Piece.replicas``); its partial sums them up per replica set
    replicas: dict[str, int] = field(default_factory=dict)


@dataclass
class Round:
    plans: list[FilePlan]
    nbytes: int  # arena bytes


def split_rows(piece: Piece, max_bytes: int) -> list[Piece]:
    """Cut a piece along its first dimension into parts of at most ``max_bytes`` (whole rows;
    a single row larger than that stays whole)."""
    nbytes = piece.view.numel() * piece.view.element_size()
    if nbytes <= max_bytes or piece.view.dim() == 0 or piece.view.shape[0] <= 1:
        return [piece]
    row = nbytes // piece.view.shape[0]
    per = max(1, max_bytes // max(row, 1))
    out = []
    for a in range(0, piece.view.shape[0], per):
        n = min(per, piece.view.shape[0] - a)
        box = Box((piece.box.offsets[0] + a, *piece.box.offsets[1:]), (n, *piece.box.sizes[1:]))
        out.append(
            Piece(
                piece.name,
                piece.global_shape,
                piece.dtype,
                box,
                piece.view.narrow(0, a, n),
                piece.replica,
                piece.replicas,
            )
        )
    return out


def plan_rounds(pieces: list[Piece], threads: int, budget: int | None, *,
                tight: bool = False) -> list[Round]:
    """The rounds (one unless over ``budget``) and files of ``pieces``. ``tight``: no padding
    beyond what the item sizes need (files not padded for O_DIRECT, pieces aligned to their item
    size): an offline rewrite of many small pieces, where padding would be a
    share of the bytes and a direct write gains nothing."""
    cfg = config.get()
    files = threads * cfg.files_per_thread
    alignment, piece_align = (1, None) if tight else (cfg.file_alignment, PIECE_ALIGN)

    def packed(group: list[Piece]) -> Round:
        plans, size = pack(group, files, alignment, cfg.min_file_bytes, piece_align)
        return Round(plans, size)

    total = sum(p.view.numel() * p.view.element_size() for p in pieces)
    if budget is None or total <= budget:
        return [packed(pieces)]
    # leave room for alignment padding inside a round
    room = max(cfg.file_alignment, budget - files * cfg.file_alignment - 64 * len(pieces))
    parts = [q for p in pieces for q in split_rows(p, room)]
    sizes = [p.view.numel() * p.view.element_size() for p in parts]
    return [packed([parts[i] for i in run]) for run in runs_within(sizes, room)]


def runs_within(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` in runs of at most ``limit`` in total; an item above
    ``limit`` is a run of its own."""
    runs: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if current and total + n > limit:
            runs.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        runs.append(current)
    return runs


def stage(arena: torch.Tensor | HostArray, plans: list[FilePlan]) -> None:
    """The copy the caller waits for. On CUDA, copies are issued on a side stream into pinned
    memory and synchronised here, so "staged" always means the source may change."""
    if any(s.piece.view.is_cuda for p in plans for s in p.slots):
        import torch

        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for plan in plans:
                for s in plan.slots:
                    copy_into(arena, s.offset, s.piece.view)
        stream.synchronize()
        return
    base = arena.data_ptr()
    flat: list[tuple[int, int, int]] = []
    strided = []
    for plan in plans:
        for s in plan.slots:
            v = s.piece.view
            if v.is_contiguous() and v.device.type == "cpu":
                flat.append((base + s.offset, v.data_ptr(), v.numel() * v.element_size()))
            else:
                strided.append(s)
    if strided:  # strided views: the array's own copy (no autograd on a tensor's)
        with no_grad(arena):
            for s in strided:
                copy_into(arena, s.offset, s.piece.view)
    copy_all(flat)


class RankWriter:
    """Writes one rank's files for one attempt, round by round, then its partial manifest."""

    def __init__(
        self, storage: Storage, io: Executor, pool: StagingPool, codec: str, level: int,
        gate: Callable[[int], None] | None = None,
    ) -> None:
        """``gate(nbytes)``: the node agent's pace and stop (:class:`ckptd.agent.gate.Gate`),
        called in the I/O thread before each file (with 0) and before each block the storage
        writes of it (``Storage.write_file``'s gate); what it raises fails that file."""
        self.storage = storage
        self.io = io
        self.pool = pool
        self.codec = codec
        self.level = level
        self.gate = gate

    def start_files(
        self,
        share: Share,
        arena: Arena,
        rnd: Round,
        first_index: int,
        *,
        stage_first: bool,
        codec: str | None = None,
        framing: Framing | None = None,
    ) -> list[Future[ChunkList]]:
        """Hand each file of the round to an I/O thread; with ``stage_first``, stage each file's
        pieces just before, so the disk starts on file 0 while file 1 is being staged.
        ``codec`` overrides the writer's for these files; ``framing``: this process's settings
        unless given (a job's, in the node agent)."""
        codec = codec or self.codec
        framing = framing or Framing.current()
        futures: list[Future[ChunkList]] = []
        try:
            for plan in rnd.plans:
                if stage_first:
                    stage(arena.buffer, [plan])
                path = layout.data_file(share.attempt, share.rank, first_index + plan.index)
                futures.append(
                    self.io.submit(
                        self._write_file,
                        self.storage,
                        layout.step_dir(share.step),
                        path,
                        arena.buffer,
                        plan,
                        codec,
                        self.level,
                        framing,
                        share.rank,
                    )
                )
        except BaseException:
            for f in futures:  # the arena must outlive every write that reads it
                f.exception()
            raise
        return futures

    def _write_file(self, storage: Storage, step_dir: str, rel_path: str,
                    arena: torch.Tensor | HostArray, plan: FilePlan, codec: str, level: int,
                    framing: Framing, rank: int) -> ChunkList:
        if self.gate is not None:
            self.gate(0)  # stopped before it starts, whatever the backend says of its blocks
        return write_file(storage, step_dir, rel_path, arena, plan, codec, level, framing, rank,
                          self.gate)

    def write_round(
        self, share: Share, arena: Arena, rnd: Round, first_index: int, codec: str | None = None
    ) -> ChunkList:
        return gather(
            self.start_files(share, arena, rnd, first_index, stage_first=False, codec=codec)
        )

    def write_partial(self, share: Share, chunks: list[tuple[str, Chunk]]) -> Manifest:
        """The rank's frame table, then its partial manifest (which names slices of it)."""
        partial = self.partial(share, chunks)
        own_partials.put_partial(self.storage, partial)
        return partial

    def partial(self, share: Share, chunks: list[tuple[str, Chunk]]) -> Manifest:
        """The rank's frame table, written, and its partial manifest, not written: for a
        writer that merges every rank's partial in the same process (``ckptd reshard``)."""
        return self.partials([(share, chunks)])[0]

    def partials(self, ranks: list[tuple[Share, list[tuple[str, Chunk]]]], *,
                 checked: bool = False) -> list[Manifest]:
        """``partial`` of several ranks of one attempt, with one frame table for them all
        (named after the first rank): a reshard to a thousand ranks writes one per wave.
        ``checked``: the caller has passed each rank's chunks through :func:`check_chunks`."""
        if not checked:
            for share, chunks in ranks:
                check_chunks(share, chunks)
        share0 = ranks[0][0]
        table = layout.frame_table(share0.attempt, share0.rank)
        blob, refs = table_file([c.frames for _, chunks in ranks for _, c in chunks
                                 if c.frames is not None])
        self.storage.write_file(f"{layout.step_dir(share0.step)}/{table}", [blob])
        out, at = [], 0
        for share, chunks in ranks:
            out.append(self._partial(share, chunks, table, refs[at : at + len(chunks)]))
            at += len(chunks)
        return out

    def _partial(self, share: Share, chunks: list[tuple[str, Chunk]], table: str,
                 refs: Sequence[tuple[int, int, str]]) -> Manifest:
        by_name: dict[str, list[Chunk]] = {}
        for (name, c), (first, count, digest) in zip(chunks, refs, strict=True):
            # as a reader decodes it: the chunk names its slice of the frame table (the table
            # itself is in the file; the partial does not hold it) — not dataclasses.replace:
            # 3x the time
            by_name.setdefault(name, []).append(Chunk(
                c.box, c.file, c.offset, c.length, c.codec, c.frame_bytes, None, c.rank,
                FrameRef(table, first, count, digest)))
        # what it wrote, in full; what it holds but a replica wrote, summed up per replica set
        # (the coordinator checks that the set's members wrote all of it), or by name when the
        # writer knows no copies: a partial grows with the rank's writes, not with the model
        tensors = {
            n: TensorEntry(e.dtype_name, e.shape, tuple(by_name.get(n, ())))
            for n, e in share.declared.items() if n in by_name or not math.prod(e.shape)
        }
        copies = {n: r for n, r in share.replicas.items() if r > 1 and n in share.declared}
        holds = tuple(sorted(n for n in share.declared if n not in tensors and n not in copies))
        sets: dict[int, list[str]] = {}
        for n, r in copies.items():
            sets.setdefault(r, []).append(n)
        replicated = []
        for r, names in sorted(sets.items()):
            names.sort()
            replicated.append(ReplicaSet(r, len(names), names_digest(names),
                                         tuple(n for n in names if n in tensors)))
        return Manifest(
            share.step,
            share.attempt,
            share.world_size,
            time.time(),
            tensors,
            share.values,
            {str(share.rank): share.locals} if share.locals else {},
            share.training,
            rank=share.rank,
            holds=holds,
            replicated=tuple(replicated),
            tuples=share.tuples,
        )

    def write_rounds(
        self,
        share: Share,
        rounds: list[Round],
        on_round: Callable[[int], None] | None = None,
        codec: str | None = None,
    ) -> list[tuple[str, Chunk]]:
        """Stage and write every round in this thread (the over-budget path, offline tools)."""
        chunks: list[tuple[str, Chunk]] = []
        index = 0
        for i, rnd in enumerate(rounds):
            arena = self.pool.acquire(rnd.nbytes)
            try:
                stage(arena.buffer, rnd.plans)
                chunks += self.write_round(share, arena, rnd, index, codec)
            finally:
                self.pool.release(arena)
            index += len(rnd.plans)
            if on_round:
                on_round(i)
        return chunks

    def discard(self, share: Share, files: int, *, partial: bool = False) -> None:
        discard_share(self.storage, share, files, partial=partial)


def check_chunks(share: Share, chunks: list[tuple[str, Chunk]]) -> None:
    """What a rank's partial may hold: chunks of tensors it declared, each with its frames."""
    unknown = {name for name, _ in chunks} - set(share.declared)
    if unknown:
        raise CkptdError(f"rank {share.rank}: chunks written for undeclared tensors "
                         f"{sorted(unknown)}")
    if any(c.frames is None for _, c in chunks):
        raise CkptdError(f"rank {share.rank}: a chunk without frames cannot be written")


def discard_share(storage: Storage, share: Share, files: int, *, partial: bool = False) -> None:
    """Best effort: a failed save should not keep holding space (a full disk). ``partial``: its
    partial manifest too (once the attempt failed for good: no commit can use it)."""
    names = [layout.data_file(share.attempt, share.rank, i) for i in range(files)]
    paths = [f"{layout.step_dir(share.step)}/{name}"
             for name in [*names, layout.frame_table(share.attempt, share.rank)]]
    if partial:
        paths.append(layout.partial_path(share.step, share.attempt, share.rank))
    for path in paths:
        try:
            storage.remove(path)
        except OSError as e:
            log.warning("ckptd: could not remove %s: %s", path, e)


def stored_bytes(chunks: list[tuple[str, Chunk]]) -> int:
    return sum(c.frames.total for _, c in chunks if c.frames is not None)


def n_files(rounds: list[Round]) -> int:
    return sum(len(r.plans) for r in rounds)


def check_unmodified(plans: list[FilePlan], arena: torch.Tensor) -> None:
    import torch

    for plan in plans:
        for s in plan.slots:
            v = s.piece.tensor
            staged = arena[s.offset : s.offset + s.nbytes].view(v.dtype).view(v.shape)
            if not torch.equal(staged.cpu(), v.detach().cpu()):
                raise CorruptCheckpoint(
                    f"{s.piece.name}: modified before wait_staged() returned (overlap=True "
                    "requires the state to stay unchanged until then)"
                )


__all__ = [
    "check_unmodified",
    "Share",
    "Round",
    "RankWriter",
    "plan_rounds",
    "runs_within",
    "stage",
    "split_rows",
    "stored_bytes",
    "n_files",
]
