"""A save's background half: one value (:class:`SaveJob`) and one function (:func:`run`).

A rank's save is planned and staged by its :class:`~ckptd.writer.save.Saver`; what follows —
the data files (each frame checksummed), the frame table and the partial manifest, on rank 0
the merge and the commit, a failure's record, then the retention the commit owes — is
:func:`run` over the job and the staged arena, whoever executes it: the training process's own
threads (:class:`~ckptd.writer.executor.InProcess`) or the node agent, another process that
maps the same staged memory (``ckptd.agent``). A job carries everything that defines the
checkpoint it makes (the plan, the codec, the framing, the commit's parameters), so the two
write the same bytes.

    run:  [wait for the retention the previous commit started, if it still runs]
          files -> frame table + partial -> (rank 0) merge + commit -> start retention
          on a failure: record it (the process group's store, then storage), remove what this
          rank wrote that no commit can use any more, raise

The other ranks' wait for the commit is the Saver's (it completes their handles); an executor
that stops a write between two blocks (a stopping agent handing the save to a peer) raises
:class:`Interrupted` from its gate, and then nothing is recorded or removed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptd.errors import CkptdError
from ckptd.policies import Retention
from ckptd.storage import Storage
from ckptd.writer import commit, failures, retention
from ckptd.writer.files import ChunkList, Framing, gather
from ckptd.writer.group_store import GroupStore
from ckptd.writer.partial_groups import Groups
from ckptd.writer.pipeline import RankWriter, Round, Share, discard_share, stored_bytes
from ckptd.writer.staging import Arena, StagingPool

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CommitParams:
    """What the commit needs besides the partials."""

    run_id: str
    generation: int
    overwrite: bool
    retention: Retention | None  # what rank 0 keeps after its commit (None: every step)
    incarnation: str  # how the node agent tells restarts apart (SaveOptions.incarnation)
    timeout_s: float | None = None  # the saving process's commit_timeout_s (None: the runner's)


@dataclass
class SaveJob:
    """One rank's background half of one save."""

    share: Share
    round: Round  # the files, each a range of the staged arena
    codec: str
    level: int
    framing: Framing
    commit: CommitParams
    nfiles: int | None = None  # files in all (a save over the host budget: several rounds)

    @property
    def files(self) -> int:
        return self.nfiles if self.nfiles is not None else len(self.round.plans)


class Interrupted(CkptdError):
    """The executor stopped this write between two blocks (its gate raised it): the files
    written so far stay (and the one it stopped, unfinished), nothing is recorded as failed —
    another writer takes the share over, or this one goes on later (``written``: the chunks of
    each file written, by index, for :func:`run`'s ``written``)."""

    def __init__(self, message: str, written: dict[int, ChunkList] | None = None) -> None:
        super().__init__(message)
        self.written = written or {}


@dataclass(frozen=True)
class Written:
    """What :func:`run` did."""

    nbytes: int  # stored bytes of this rank's files
    write_s: float  # from the start of the files to the partial (and on rank 0 the commit)
    chunks: ChunkList


def run(job: SaveJob, storage: Storage, io: Executor, arena: torch.Tensor, *,
        signals: GroupStore, owed: retention.Owed | None = None,
        give_up: Callable[[list[int]], str | None] | None = None,
        gate: Callable[[int], None] | None = None,
        written: dict[int, ChunkList] | None = None,
        started: list[Future[ChunkList]] | None = None,
        chunks: ChunkList | None = None, only_commit: bool = False,
        groups: Groups | None = None) -> Written:
    """The background half of ``job`` over its staged ``arena`` (see the module docstring).

    ``owed``: the executor's retention, waited for before the files and started again in the
    background after rank 0's commit (None: none here). ``give_up``: the commit's
    (:func:`ckptd.writer.commit.coordinate`). ``gate``: passed before each file and each block
    the storage writes of it.
    Where the files are already under way or done: ``started`` (their futures: staged and
    started file by file in the caller's thread), ``chunks`` (every file written: a save over
    the host budget, written round by round), ``written`` (some files written: an interrupted
    run's), ``only_commit`` (the partial is in place: a lost node agent's job, taken over).
    ``groups``: the partial's frame table shared with the ranks of the same attempt that this
    process writes at the same time (the node agent: :mod:`ckptd.writer.partial_groups`)."""
    share = job.share
    if owed is not None:
        owed.settle()  # the previous commit's, if it still runs: this save needs its space
    t0 = time.perf_counter()
    if not only_commit:
        chunks = _write(job, storage, io, arena, signals, gate, written, started, chunks,
                        groups)
    write_s = time.perf_counter() - t0
    if share.rank == 0:
        try:
            commit.coordinate(storage, share.step, share.attempt, share.world_size,
                              job.commit.run_id, generation=job.commit.generation,
                              overwrite=job.commit.overwrite, signals=signals, give_up=give_up,
                              timeout_s=job.commit.timeout_s)
        except BaseException:
            if failures.attempt_failed(storage, share.step, share.attempt, signals):
                discard(storage, job, partial=True)  # never committable
            raise
        write_s = time.perf_counter() - t0
        if owed is not None:
            owed.owe(storage, job.commit.retention)
    return Written(stored_bytes(chunks) if chunks else 0, write_s, chunks or [])


def _write(job: SaveJob, storage: Storage, io: Executor, arena: torch.Tensor, signals: GroupStore,
           gate: Callable[[int], None] | None, written: dict[int, ChunkList] | None,
           started: list[Future[ChunkList]] | None, chunks: ChunkList | None,
           groups: Groups | None) -> ChunkList:
    """The files (unless ``chunks``) and the partial; a failure recorded and cleaned up."""
    share = job.share
    writer = RankWriter(storage, io, StagingPool(1), job.codec, job.level, gate)
    done = dict(written or {})
    try:
        if chunks is None:
            if started is not None:
                futures, plans = started, job.round.plans
            else:
                plans = [p for p in job.round.plans if p.index not in done]
                futures = writer.start_files(share, Arena(arena), Round(plans, job.round.nbytes),
                                             0, stage_first=False, codec=job.codec,
                                             framing=job.framing)
            try:
                gather(futures)
            finally:
                done.update({p.index: f.result() for p, f in zip(plans, futures, strict=True)
                             if f.exception() is None})
            chunks = [c for i in sorted(done) for c in done[i]]
        # (a stop after the last file changes nothing)
        if groups is not None:
            groups.write_partial(writer, share, chunks)
        else:
            writer.write_partial(share, chunks)
    except Interrupted as e:
        raise Interrupted(str(e), done) from None
    except BaseException as e:
        # this rank's share failed: tell the others, or they wait for the commit timeout
        failures.record_failure(storage, signals, share.step, share.attempt, share.rank, e)
        discard(storage, job)
        raise
    return chunks


def discard(storage: Storage, job: SaveJob, *, partial: bool = False) -> None:
    """Best effort: the files of a failed share go (a full disk must not stay full);
    ``partial``: its partial manifest too (the attempt failed for good)."""
    discard_share(storage, job.share, job.files, partial=partial)


__all__ = ["CommitParams", "Interrupted", "SaveJob", "Written", "discard", "run"]
