"""The save path: one :class:`Saver` per writing rank and root does every save from a described
state to its commit.

    plan     cut the rank's writer pieces into files (and into rounds over the host budget)
    stage    copy them into a staging arena — the only part the caller waits for
    write    the files, in parallel on the I/O threads
    partial  this rank's partial manifest
    commit   the coordinator (rank 0) merges the partials and commits (:mod:`.commit`); the
             other ranks wait for it. Then the metrics line; retention is owed, and
             settled once the next save is staged or the Saver closes.

Staging is one mechanism, :meth:`Saver._stage`, run in one of two places: in the caller's
thread (the default: ``save_async`` returns once the state is staged) or on the save thread
(``overlap=True``: the caller gets the handle at once and calls ``wait_staged()``). Within it,
files are either all staged before the writers start, or staged one after another with the
writers starting on each (``config.pipelined_staging``); a state over the host budget is staged
and written round by round, which makes the caller wait until it is durable.

With an :class:`~ckptd.writer.remote.Offload` (the node agent, :mod:`ckptd.agent`) the arena
is the agent's shared memory and, once staged, the job is handed to the agent before
``save_async`` returns (:mod:`.handover`, a base class of the Saver: the hand-over, the agent's
reply, the fallback to saving in process when the agent is lost).

Everything after staging runs on a single save thread per Saver, so saves of one rank commit
in order. No collectives happen here: a rank's failure reaches the others through storage and
the process group's store (:mod:`.signals`).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd import config
from ckptd.errors import CkptdError
from ckptd.manifest import Chunk, TensorEntry, codecs, layout
from ckptd.sharding import Described
from ckptd.storage import Storage
from ckptd.storage.base import extended
from ckptd.writer import commit, exiting, remote, retention
from ckptd.writer.autocodec import AutoCodec
from ckptd.writer.files import gather
from ckptd.writer.handle import SaveHandle, SaveResult, SkippedHandle
from ckptd.writer.handover import AgentHandover
from ckptd.writer.pipeline import (
    RankWriter,
    Round,
    Share,
    check_unmodified,
    n_files,
    plan_rounds,
    stage,
    stored_bytes,
)
from ckptd.writer.remote import AgentLost, Offload, Ticket
from ckptd.writer.signals import Signals
from ckptd.writer.staging import Arena, StagingPool

log = logging.getLogger("ckptd")


@dataclass(frozen=True)
class SaveOptions:
    """How one rank saves under one root (the Checkpointer's configuration)."""

    rank: int
    world_size: int
    run_id: str
    keep_last: int = 3
    compression: str | None = None  # None, "zstd[:level]", "auto"
    threads: int = 4
    max_inflight: int = 1
    on_busy: str = "block"  # or "skip"
    host_budget_bytes: int | None = None
    debug_overlap: bool = False  # check at wait_staged() that the state was not modified
    attempt_base: int = 0  # the first attempt is number base + 1 (world.agree_attempt_base)

    @property
    def incarnation(self) -> str:
        """This job incarnation's name for the node agent, which tells restarts apart by it
        (its drain, :mod:`ckptd.agent.orphans`): the run id, and the attempt base when a
        caller-chosen run id may be the same across restarts."""
        return f"{self.run_id}@{self.attempt_base}" if self.attempt_base else self.run_id


@dataclass
class _Job:
    """One save between ``save_async`` and its commit."""

    share: Share
    rounds: list[Round]
    handle: SaveHandle
    codec: str  # this save's codec (compression="auto" chooses per save; urgent saves are raw)
    overwrite: bool
    arena: Arena | None = None  # one round: staged in an arena, written in the background
    chunks: list[tuple[str, Chunk]] = field(default_factory=list)
    futures: list[Future[list[tuple[str, Chunk]]]] | None = None  # files being written
    t_write: float = float("inf")  # when the first file was handed to an I/O thread
    pool: StagingPool | None = None  # where ``arena`` goes back to
    kept: bool = False  # the agent holds on to the arena (it gives it back in a later reply)
    ticket: Ticket | None = None  # the agent holds the job


class Saver(AgentHandover):
    """Every save of one rank under one root. The coordinator (rank 0) claims the root when
    the Saver is created: a job still writing under the previous owner fails its next commit."""

    def __init__(self, storage: Storage, options: SaveOptions, signals: Signals,
                 io: ThreadPoolExecutor, offload: Offload | None = None) -> None:
        """``io``: the I/O threads that write the files (the caller's; shared with loads).
        ``offload``: the node agent, which takes each save over once it is staged."""
        if options.on_busy not in ("block", "skip"):
            raise ValueError(f"on_busy must be 'block' or 'skip', got {options.on_busy!r}")
        self.storage = storage
        self.options = options
        self.auto = AutoCodec(options.threads) if options.compression == "auto" else None
        self.codec, level = codecs.parse_compression(None if self.auto else options.compression)
        self.max_inflight = max(1, options.max_inflight)
        self.offload = offload
        self._local_pool: StagingPool | None = None  # set once the agent is lost
        self.pool = (remote.pool_for(offload, self.max_inflight) if offload is not None
                     else StagingPool(self.max_inflight))
        self.signals = signals
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ckptd-save")
        self._writer = RankWriter(storage, io, self.pool, self.codec, level)
        self._handles: list[SaveHandle] = []
        self._retention = retention.Owed()
        self._seq = 0
        self.generation = 0
        if options.rank == 0:
            self.generation = commit.claim(storage, options.run_id)

    # ------------------------------------------------------------------ the caller's half
    def save_async(
        self,
        described: Described,
        step: int,
        *,
        overlap: bool = False,
        training: dict[str, Any] | None = None,
        urgent: bool = False,
        overwrite: bool = False,
        started: float | None = None,
    ) -> SaveHandle:
        """Plan and stage ``described`` for ``step`` (unless ``overlap``) and hand the rest to
        the save thread. A failure before the hand-off fails the handle and is raised here.
        ``started``: ``time.perf_counter()`` when the caller's save began (the stall counts
        from there: describing the state is part of it)."""
        opts = self.options
        t0 = time.perf_counter() if started is None else started
        self.raise_pending()
        inflight = [h for h in self._handles if not h.done()]
        if len(inflight) >= self.max_inflight:
            if opts.on_busy == "skip":
                log.warning("ckptd: step %d skipped: %d save(s) still in flight",
                            step, len(inflight))
                return SkippedHandle(step, self.storage.url)
            for h in inflight[: len(inflight) - self.max_inflight + 1]:
                h.wait_done()
            self.raise_pending()
        self._seq += 1
        share = Share(
            step=step,
            attempt=f"{opts.run_id}-{opts.attempt_base + self._seq:06d}",
            rank=opts.rank,
            world_size=opts.world_size,
            declared={p.name: TensorEntry(p.dtype, p.global_shape) for p in described.pieces},
            values=_json_copy(described.values) if opts.rank == 0 else {},
            locals=_json_copy(
                {k: v for k, v in described.locals.items() if not isinstance(v, torch.Tensor)}
            ),
            training=_json_copy(training or {}),
        )
        rounds = self.plan(described)
        if len(rounds) > 1 and overlap:
            raise CkptdError(
                f"step {step}: overlap=True needs the state staged at once, but it needs "
                f"{sum(r.nbytes for r in rounds)} bytes and the host budget is "
                f"{opts.host_budget_bytes}"
            )
        handle = SaveHandle(step, f"{self.storage.url}/{layout.step_dir(step)}")
        self._handles = [h for h in self._handles if not h.done()] + [handle]
        codec = codecs.RAW if urgent else self.auto.choose() if self.auto else self.codec
        job = _Job(share, rounds, handle, codec, overwrite)
        submitted = False
        try:
            if not overlap:
                self._stage(job)
                handle.stall_s = time.perf_counter() - t0
            self._thread.submit(self._finish, job, overlap)
            submitted = True
        except BaseException as e:  # Ctrl-C included: the exit drain must not wait on it
            if not submitted:
                self._abandon(job, e)
            raise
        if overlap:
            handle.stall_s = time.perf_counter() - t0
        return handle

    def plan(self, described: Described) -> list[Round]:
        pieces = [p for p in described.pieces if p.is_writer]
        return plan_rounds(pieces, self.options.threads, self.options.host_budget_bytes)

    def reserve(self, described: Described) -> int:
        """Allocate (and fault in) the staging memory ``described`` will need."""
        need = max(r.nbytes for r in self.plan(described))
        # with the node agent, one more arena per step it keeps (it holds on to the arena) and
        # one while it copies a step to a peer
        extra = self.offload.keep + int(self.offload.peers) if self.offload is not None else 0
        arenas = [self.pool.acquire(need) for _ in range(1 + extra)]
        for arena in arenas:
            self.pool.release(arena)
        return need

    def _stage(self, job: _Job) -> None:
        """Copy the state into host memory and start the file writes; then the caller may
        modify the state. Over the host budget: stage and write round by round (blocking)."""
        share, rounds = job.share, job.rounds
        if len(rounds) > 1:
            log.warning(
                "ckptd: step %d needs %d bytes of staging, over the host budget of %d: "
                "writing it in %d blocking rounds", share.step, sum(r.nbytes for r in rounds),
                self.options.host_budget_bytes, len(rounds))
            job.chunks = self._writer.write_rounds(share, rounds, codec=job.codec)
        else:
            try:
                job.pool = self.pool
                job.arena = job.pool.acquire(rounds[0].nbytes)
            except AgentLost as e:  # it died or hangs: this save and the next stage here
                self._agent_lost(e)
                job.pool = self.pool
                job.arena = job.pool.acquire(rounds[0].nbytes)
            if self.options.debug_overlap:
                buffer, plans = job.arena.tensor, rounds[0].plans
                job.handle.on_wait_staged.append(lambda: check_unmodified(plans, buffer))
            job.t_write = time.perf_counter()
            if self._hand_over(job):
                job.handle.mark_staged()
                return
            pipelined = config.pipelined_staging(self.options.threads)
            if not pipelined:  # every core copies first; then the writers start
                stage(job.arena.buffer, rounds[0].plans)
            job.futures = self._writer.start_files(
                share, job.arena, rounds[0], 0, stage_first=pipelined, codec=job.codec)
        job.handle.mark_staged()

    def _abandon(self, job: _Job, error: BaseException) -> None:
        """A save that failed (or was interrupted) before the hand-off: no write may still read
        the arena when it goes back to the pool; its files go; the handle fails with the error
        that is raised to the caller right here."""
        for f in job.futures or ():
            f.exception()
        if job.arena is not None and job.pool is not None:
            job.pool.release(job.arena)
        self._writer.discard(job.share, n_files(job.rounds))
        job.handle.mark_failed(error, reported=True)

    # ------------------------------------------------------------------ the save thread's half
    def _finish(self, job: _Job, stage_here: bool) -> None:
        """Stage (``overlap=True``), finish the writes, write the partial, commit or wait for
        the commit; then retention is owed (settled at the next save's start here, or at
        close)."""
        h, share, opts = job.handle, job.share, self.options
        partial_written = False
        agent_failed = False  # the agent reported the failure: it recorded it, and cleaned up
        on_agent: int | None = None  # the agent's stored bytes, once it did its part
        try:
            try:
                if stage_here:
                    self._stage(job)
                t_staged = time.perf_counter()
                self._retention.settle()  # the previous commit's, now that no copy runs
                if job.ticket is not None:
                    try:
                        on_agent = self._finish_on_agent(job)
                    except exiting.Abandoned:
                        raise
                    except BaseException:
                        # the agent records its own failures; only a lost agent (which
                        # _finish_on_agent carries on from) leaves it to us
                        agent_failed = True
                        raise
                    partial_written = True
                if job.futures is not None:
                    job.chunks = gather(job.futures)
                    partial_written = False
                    if self.auto is not None and job.arena is not None:
                        self.auto.observe_save(
                            stored_bytes(job.chunks), time.perf_counter() - job.t_write,
                            job.codec, [(s.piece.tensor, s.offset, s.nbytes)
                                        for p in job.rounds[0].plans for s in p.slots],
                            job.arena.tensor)
            finally:
                if job.arena is not None and job.pool is not None and not job.kept:
                    job.pool.release(job.arena)  # every write that reads it has returned
            if job.ticket is None or job.futures is not None:
                self._writer.write_partial(share, job.chunks)
            partial_written = True
            if h.handed_to is not None:  # the peer's agent commits (on rank 0) or writes it
                commit.wait_committed(self.storage, share.step, share.attempt, self.signals)
            elif opts.rank == 0 and on_agent is not None:
                self.signals.publish_committed(share.attempt)  # the agent committed
            elif opts.rank == 0:
                commit.coordinate(self.storage, share.step, share.attempt, opts.world_size,
                                  opts.run_id, generation=self.generation,
                                  overwrite=job.overwrite, signals=self.signals)
            else:
                commit.wait_committed(self.storage, share.step, share.attempt, self.signals)
                if on_agent is not None:
                    self._tell_committed(share.rank, share.step)
            nbytes = (on_agent if on_agent is not None else stored_bytes(job.chunks)
                      if job.chunks else sum(r.nbytes for r in job.rounds))
            result = SaveResult(share.step, h.url, nbytes, h.stall_s,
                                time.perf_counter() - t_staged, h.handed_to)
            self._record(result)
            h.mark_committed(result)
        except exiting.Abandoned as e:  # the process exits: others may still finish it
            log.warning("ckptd: %s", e)
            h.mark_failed(e, reported=True)  # said once, here
            return
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            log.error("ckptd: save of step %d failed: %s", share.step, e)
            h.mark_failed(e)
            # best effort, after the error is delivered (an unreachable store retries every
            # request); this thread still finishes it before the next save
            if agent_failed:  # it recorded the failure on storage: the store learns it too
                commit.publish_recorded(self.storage, self.signals, share.step, share.attempt,
                                        opts.rank, e)
            elif not partial_written:  # once a partial names them, a commit may still use them
                # this rank's share failed: tell the others, or they wait for the timeout
                commit.record_failure(self.storage, self.signals, share.step, share.attempt,
                                      opts.rank, e)
                self._writer.discard(share, n_files(job.rounds))
            elif commit.attempt_failed(self.storage, share.step, share.attempt, self.signals):
                # another rank's failure (a full disk, say) failed the step for good: no commit
                # can use this share, whose bytes would otherwise fill the disk the next save
                # needs (written here or by the node agent: the same names)
                self._writer.discard(share, n_files(job.rounds), partial=True)
            return
        if opts.rank == 0 and on_agent is None:  # (the agent's own, if it committed)
            # deleting a large old step takes a while: not before "committed", and not while
            # the next save stages (retention.Owed)
            self._retention.owe(self.storage, opts.keep_last)

    def _record(self, r: SaveResult) -> None:
        line = {"step": r.step, "rank": self.options.rank,
                "world_size": self.options.world_size, "nbytes": r.nbytes,
                "stall_s": round(r.stall_s, 6), "write_s": round(r.write_s, 6),
                "time": time.time()}
        log.info("ckptd save %s", json.dumps(line))
        if self.options.rank == 0:
            try:
                extended(self.storage).append_text(layout.METRICS, json.dumps(line) + "\n")
            except OSError as e:
                log.warning("ckptd: could not append metrics: %s", e)

    # ------------------------------------------------------------------ waiting
    def raise_pending(self) -> None:
        """Raise the first background error not yet raised to the caller."""
        for h in self._handles:
            err = h.take_error()
            if err is not None:
                raise err

    def wait(self) -> None:
        """Every in-flight save done; raise the first background error."""
        for h in list(self._handles):
            h.wait_done()
        self.raise_pending()

    def close(self) -> None:
        """Drain, settle the retention owed, then stop the save thread (raises a pending
        background error)."""
        try:
            self.wait()
            # every job is done: the retention the agent owes, as this process's own below
            # (not after an error: a job abandoned at exit may still run in the agent)
            if (self.offload is not None and self._local_pool is None and self.offload.alive
                    and not exiting.active()):
                try:
                    self.offload.settle()
                except CkptdError as e:
                    log.warning("ckptd: the node agent did not settle retention: %s", e)
        finally:
            self._thread.submit(self._retention.settle)
            self._thread.shutdown(wait=True)


def _json_copy(value: Any) -> Any:
    """A snapshot of JSON-able values, taken at the call (the caller may change them after)."""
    return json.loads(json.dumps(value))


__all__ = ["Saver", "SaveOptions"]
