"""Who runs a save's background half (:func:`ckptd.writer.job.run`): the seam between a
:class:`~ckptd.writer.save.Saver` (plan, stage, submit) and an executor.

An executor gives the Saver its staging memory (``pool``), takes each staged job
(:meth:`Executor.start`, in the caller's thread) and carries it to its end (:meth:`Executor.
finish`, on the Saver's save thread): the files, the partial and, on rank 0, the commit. Two
executors exist: :class:`InProcess` (this process's I/O threads) and the node agent's
(``ckptd.agent.executor.AgentExecutor``: another process writes from the same staged memory and
survives this one; it falls back to an :class:`InProcess` of its own when the agent is lost).
The other ranks' wait for the commit, the handle and the metrics are the Saver's, whichever
executor ran the job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor as Threads
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ParamSpec, Protocol, TypeVar

from ckptd.storage import Storage
from ckptd.writer import retention
from ckptd.writer.autocodec import AutoCodec
from ckptd.writer.files import ChunkList
from ckptd.writer.group_store import GroupStore
from ckptd.writer.job import SaveJob, run
from ckptd.writer.pipeline import RankWriter, Round, Share, stored_bytes
from ckptd.writer.staging import Arena, StagingPool

P = ParamSpec("P")
T = TypeVar("T")

# A job of one file of at most this many staged bytes has its file written by the thread that
# runs the job (the save thread in ``finish``; the node agent's job thread) instead of an I/O
# thread: for a small file the hand-off (a queue, a worker's wake-up, a future the job's
# thread waits on) costs more CPU than the overlap buys, on a host whose ranks share few cores.
# Larger files, and any job with several, keep the I/O threads.
INLINE_BYTES = 1 << 20


@dataclass
class Pending:
    """A job an executor has taken, until :meth:`Executor.finish`."""

    job: SaveJob
    arena: Arena | None  # the staged bytes (None: a save over the host budget, written already)
    pool: StagingPool | None  # where ``arena`` goes back to
    futures: list[Future[ChunkList]] | None = None  # its files, under way in this process
    chunks: ChunkList | None = None  # its files, written (a save over the host budget)
    ticket: Any = None  # the node agent's hold on it (its executor's business)
    only_commit: bool = False  # its files and partial are in place (a lost agent wrote them)
    t_write: float = 0.0  # when its first file was handed to an I/O thread
    t_files: float = 0.0  # when its last file was written (in this process)
    inline: bool = False  # its one small file is written by ``finish`` (InProcess.start)


@dataclass(frozen=True)
class Outcome:
    """How a job ended: its stored bytes, and whether the commit is done (rank 0: it is, unless
    ``handed_to`` — a peer's node agent writes the share and, on rank 0, commits; another rank:
    ``committed``, when the executor saw the commit happen — the node agent that ran rank 0's
    job — and took note of it, else the rank waits for it)."""

    nbytes: int
    write_s: float
    handed_to: str | None = None
    committed: bool = False
    executor: str = "process"  # what wrote it: "process" or "agent"


class Executor(Protocol):
    """Where a Saver's jobs run (the module docstring)."""

    @property
    def name(self) -> str:
        """``"process"`` or ``"agent"``: what runs the saves now."""

    @property
    def pipelines(self) -> bool:
        """Whether a job's files may start while the caller still stages, file by file."""

    @property
    def spare_arenas(self) -> int:
        """Arenas it may hold besides the one being staged (``reserve()`` allocates them)."""

    @property
    def signals(self) -> GroupStore:
        """How this rank's failures and commits reach the other ranks at once."""

    @property
    def pool(self) -> StagingPool: ...

    def pool_for(self, nbytes: int) -> StagingPool:
        """Where a save that stages ``nbytes`` stages (and so, who writes it)."""

    @property
    def alive(self) -> bool: ...

    @property
    def hands_off(self) -> bool:
        """Whether a save it cannot write inside a SIGTERM's grace window may go to a peer."""

    def start(self, job: SaveJob, arena: Arena, pool: StagingPool, *,
              stage_first: bool) -> Pending:
        """Take ``job`` over (its arena staged, or with ``stage_first`` staged file by file as
        its files start). Returns once it holds the job."""

    def written(self, job: SaveJob, chunks: ChunkList) -> Pending:
        """Take over a job whose files the caller wrote (a save over the host budget)."""

    def finish(self, pending: Pending) -> Outcome:
        """Carry the job to its end; raises its failure (recorded and cleaned up already)."""

    def saw_commit(self, pending: Pending) -> None:
        """This rank saw the step of the job it finished commit (a rank other than 0)."""

    def settle(self) -> None:
        """The retention owed, now: the Saver closes."""

    def close(self) -> None: ...


class InProcess:
    """This process's own I/O threads run the jobs (``io``, shared with loads); a job of one
    file of at most ``INLINE_BYTES`` is written by the save thread itself, in :meth:`finish`."""

    name = "process"
    spare_arenas = 0
    hands_off = False
    alive = True

    def __init__(self, storage: Storage, io: Threads, signals: GroupStore, slots: int,
                 auto: AutoCodec | None = None, pool: StagingPool | None = None) -> None:
        self.storage, self.io, self.signals, self.auto = storage, io, signals, auto
        self._pool = pool if pool is not None else StagingPool(slots)
        self.owed = retention.Owed()  # after rank 0's commit, settled by its next save
        self.pipelines = True

    @property
    def pool(self) -> StagingPool:
        return self._pool

    def pool_for(self, nbytes: int) -> StagingPool:
        return self._pool

    def writer(self, codec: str, level: int) -> RankWriter:
        return RankWriter(self.storage, self.io, self._pool, codec, level)

    def start(self, job: SaveJob, arena: Arena, pool: StagingPool, *,
              stage_first: bool) -> Pending:
        pending = Pending(job, arena, pool, t_write=time.perf_counter())
        if not stage_first and self.auto is None and writes_inline(job):
            pending.inline = True  # finish() writes it (INLINE_BYTES)
            return pending
        pending.futures = self.writer(job.codec, job.level).start_files(
            job.share, arena, job.round, 0, stage_first=stage_first, codec=job.codec,
            framing=job.framing)

        def done(_: Future[ChunkList]) -> None:
            pending.t_files = max(pending.t_files, time.perf_counter())

        for f in pending.futures:
            f.add_done_callback(done)
        return pending

    def written(self, job: SaveJob, chunks: ChunkList) -> Pending:
        return Pending(job, None, None, chunks=chunks)

    def write_rounds(self, share: Share, rounds: list[Round], codec: str,
                     level: int) -> ChunkList:
        """A save over the host budget, staged and written round by round (blocking)."""
        return self.writer(codec, level).write_rounds(share, rounds, codec=codec)

    def finish(self, pending: Pending) -> Outcome:
        job = pending.job
        if pending.inline and pending.futures is None and pending.arena is not None:
            # before run()'s wait for the retention owed, as an I/O thread would have
            pending.t_write = time.perf_counter()
            writer = RankWriter(self.storage, Inline(), self._pool, job.codec, job.level)
            pending.futures = writer.start_files(job.share, pending.arena, job.round, 0,
                                                 stage_first=False, codec=job.codec,
                                                 framing=job.framing)
        try:
            out = run(job, self.storage, self.io,
                      pending.arena.tensor if pending.arena is not None else None,  # type: ignore[arg-type]
                      signals=self.signals, owed=self.owed, started=pending.futures,
                      chunks=pending.chunks, only_commit=pending.only_commit)
        finally:
            for f in pending.futures or ():
                f.exception()  # every write that reads the arena has returned
            if pending.arena is not None and pending.pool is not None:
                if self.auto is not None and pending.futures is not None:
                    self._observe(pending)
                pending.pool.release(pending.arena)
        return Outcome(out.nbytes, out.write_s)

    def _observe(self, pending: Pending) -> None:
        """Teach ``compression="auto"`` what this save's files cost."""
        assert self.auto is not None and pending.arena is not None
        futures = pending.futures or []
        if any(f.exception() is not None for f in futures):
            return
        chunks = [c for f in futures for c in f.result()]
        self.auto.observe_save(
            stored_bytes(chunks), pending.t_files - pending.t_write, pending.job.codec,
            [(s.piece.tensor, s.offset, s.nbytes) for p in pending.job.round.plans
             for s in p.slots], pending.arena.tensor)

    def saw_commit(self, pending: Pending) -> None:
        pass

    def settle(self) -> None:
        self.owed.settle()

    def close(self) -> None:
        pass


class Inline(Threads):
    """An executor that runs each call at once, in the caller's thread; its outcome (the
    value or what it raised) goes into the returned Future, as a thread pool's would."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            future.set_exception(e)
        return future


def writes_inline(job: SaveJob) -> bool:
    """Whether the thread that runs ``job`` writes its file itself (:class:`Inline`): one file
    of at most ``INLINE_BYTES``, which an I/O thread's hand-offs (a wake-up there, one back)
    would cost more than they overlap."""
    return len(job.round.plans) == 1 and job.round.nbytes <= INLINE_BYTES


__all__ = ["INLINE_BYTES", "Executor", "InProcess", "Inline", "Outcome", "Pending",
           "writes_inline"]
