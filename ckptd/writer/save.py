"""The save path: one :class:`Saver` per writing rank and root takes every save from a
described state to its commit.

    plan     cut the rank's writer pieces into files (and into rounds over the host budget)
    stage    copy them into a staging arena — the only part the caller waits for
    submit   the job (:class:`~ckptd.writer.job.SaveJob`) goes to the executor, which runs its
             background half (:func:`~ckptd.writer.job.run`: files, partial, on rank 0 the
             commit, a failure's record, retention) in this process or in the node agent
             (:mod:`.executor`)
    wait     the other ranks wait for the coordinator's commit; then the metrics line

Staging is one mechanism, :meth:`Saver._stage`, run in one of two places: in the caller's
thread (the default: ``save_async`` returns once the state is staged) or on the save thread
(``overlap=True``: the caller gets the handle at once and calls ``wait_staged()``). Within it,
files are either all staged before the writers start, or staged one after another with the
writers starting on each (``config.pipelined_staging``, in process only); a state over the host
budget is staged and written round by round, which makes the caller wait until it is durable.

Everything after staging runs on a single save thread per Saver, so saves of one rank commit
in order. No collectives happen here: a rank's failure reaches the others through storage and
the process group's store (:mod:`.group_store`).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ckptd import config
from ckptd.errors import CkptdError
from ckptd.manifest import TensorEntry, codecs, layout
from ckptd.manifest import values as typed
from ckptd.policies import KeepLast, Retention
from ckptd.sharding import Described
from ckptd.storage import Storage
from ckptd.writer import commit, exiting, failures
from ckptd.writer.autocodec import AutoCodec
from ckptd.writer.executor import Executor, InProcess, Pending
from ckptd.writer.files import Framing
from ckptd.writer.group_store import GroupStore
from ckptd.writer.handle import SaveHandle, SaveResult, skipped
from ckptd.writer.job import CommitParams, SaveJob, discard
from ckptd.writer.pipeline import Round, Share, check_unmodified, n_files, plan_rounds, stage
from ckptd.writer.staging import Arena, StagingPool

log = logging.getLogger("ckptd")


@dataclass(frozen=True)
class SaveOptions:
    """How one rank saves under one root (the Checkpointer's configuration)."""

    rank: int
    world_size: int
    run_id: str
    retention: Retention | None = KeepLast(3)  # None: every step is kept
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
class _Save:
    """One save between ``save_async`` and its commit."""

    job: SaveJob
    rounds: list[Round]
    handle: SaveHandle
    arena: Arena | None = None  # one round: staged in an arena, written in the background
    pool: StagingPool | None = None  # where ``arena`` goes back to
    pending: Pending | None = None  # the executor holds the job


class Saver:
    """Every save of one rank under one root: the caller's half (plan, stage, submit to the
    executor) and the save thread's wait for the job's end and the commit. The coordinator
    (rank 0) claims the root when the Saver is created: a job still writing under the previous
    owner fails its next commit."""

    def __init__(self, storage: Storage, options: SaveOptions, signals: GroupStore,
                 executor: Executor, auto: AutoCodec | None = None) -> None:
        """``executor``: what runs each save's background half (:mod:`.executor`): this
        process's I/O threads, or the node agent. ``auto``: with ``compression="auto"``, the
        chooser of each save's codec, which the executor teaches what writes cost."""
        if options.on_busy not in ("block", "skip"):
            raise ValueError(f"on_busy must be 'block' or 'skip', got {options.on_busy!r}")
        self.storage = storage
        self.options = options
        self.auto = (auto or AutoCodec(options.threads)) if options.compression == "auto" \
            else None
        self.codec, self.level = codecs.parse_compression(
            None if self.auto else options.compression)
        self.max_inflight = max(1, options.max_inflight)
        self.executor = executor
        self.signals = signals
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ckptd-save")
        self._handles: list[SaveHandle] = []
        self._said_wait = False  # the first wait for max_inflight is logged, the others not
        self._seq = 0
        self.generation = 0
        if options.rank == 0:
            self.generation = commit.claim(storage, options.run_id)

    @property
    def pool(self) -> StagingPool:
        """The staging memory of the next save (the executor's)."""
        return self.executor.pool

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
        inflight = self.inflight
        waited = 0.0
        if len(inflight) >= self.max_inflight:
            if opts.on_busy == "skip":
                log.warning("ckptd: step %d skipped: %d save(s) still in flight",
                            step, len(inflight))
                return skipped(step, f"{self.storage.url}/{layout.step_dir(step)}")
            waited = self._wait_for(inflight[: len(inflight) - self.max_inflight + 1], step)
            self.raise_pending()
        self._seq += 1
        share = Share(
            step=step,
            attempt=f"{opts.run_id}-{opts.attempt_base + self._seq:06d}",
            rank=opts.rank,
            world_size=opts.world_size,
            declared={p.name: TensorEntry(p.dtype, p.global_shape) for p in described.pieces},
            values=typed.snapshot(described.values) if opts.rank == 0 else {},
            locals=typed.snapshot(
                {k: v for k, v in described.locals.items() if not isinstance(v, torch.Tensor)}
            ),
            training=_json_copy(training) if training else {},
            tuples=described.tuples if opts.rank == 0 else frozenset(),
            replicas=_replicas(described),
        )
        rounds = self.plan(described)
        if len(rounds) > 1 and overlap:
            raise CkptdError(
                f"step {step}: overlap=True needs the state staged at once, but it needs "
                f"{sum(r.nbytes for r in rounds)} bytes and the host budget is "
                f"{opts.host_budget_bytes}"
            )
        handle = SaveHandle(step, f"{self.storage.url}/{layout.step_dir(step)}")
        handle.waited_s = waited
        self._handles = [*self.inflight, handle]
        codec = codecs.RAW if urgent else self.auto.choose() if self.auto else self.codec
        job = _Save(self._job(share, rounds, codec, overwrite), rounds, handle)
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

    def _wait_for(self, earlier: tuple[SaveHandle, ...], step: int) -> float:
        """Block until ``earlier`` are done (``max_inflight`` reached): the seconds waited,
        said once per Saver at WARNING with the remedies (each wait is on the handle, the
        result and the metrics line)."""
        t0 = time.perf_counter()
        log.debug("ckptd: step %d waits for the save of step(s) %s (max_inflight=%d)",
                  step, [h.step for h in earlier], self.max_inflight)
        for h in earlier:
            h._wait_done()
        waited = time.perf_counter() - t0
        if not self._said_wait:
            self._said_wait = True
            log.warning(
                "ckptd: save_async of step %d waited %.2f s for the save of step %d to finish "
                "(max_inflight=%d saves in flight): raise max_inflight (one more staging copy "
                "of host memory each), save less often, or write to faster storage. Said once; "
                "every wait is in SaveResult.waited_s and the metrics line (wait_s)",
                step, waited, earlier[-1].step, self.max_inflight)
        return waited

    @property
    def inflight(self) -> tuple[SaveHandle, ...]:
        """The saves not yet committed or failed, oldest first."""
        return tuple(h for h in self._handles if not h.done())

    def _job(self, share: Share, rounds: list[Round], codec: str, overwrite: bool) -> SaveJob:
        opts = self.options
        return SaveJob(share, rounds[0], codec, self.level, Framing.current(),
                       CommitParams(opts.run_id, self.generation, overwrite, opts.retention,
                              opts.incarnation, config.get().commit_timeout_s),
                       nfiles=n_files(rounds))

    def plan(self, described: Described) -> list[Round]:
        pieces = [p for p in described.pieces if p.is_writer]
        return plan_rounds(pieces, self.options.threads, self.options.host_budget_bytes)

    def reserve(self, described: Described) -> int:
        """Allocate (and fault in) the staging memory ``described`` will need."""
        need = max(r.nbytes for r in self.plan(described))
        # the executor may hold more arenas (the node agent keeps a step in the one it was
        # staged in, and holds one while it copies a step to a peer)
        pool = self.executor.pool_for(need)
        spare = self.executor.spare_arenas if pool is self.pool else 0
        arenas = [pool.acquire(need) for _ in range(1 + spare)]
        for arena in arenas:
            pool.release(arena)
        return need

    def _stage(self, save: _Save) -> None:
        """Copy the state into host memory and give the job to the executor; then the caller
        may modify the state. Over the host budget: stage and write round by round
        (blocking), then the executor commits."""
        job, rounds = save.job, save.rounds
        if len(rounds) > 1:
            log.warning(
                "ckptd: step %d needs %d bytes of staging, over the host budget of %d: "
                "writing it in %d blocking rounds", job.share.step,
                sum(r.nbytes for r in rounds), self.options.host_budget_bytes, len(rounds))
            chunks = _in_process(self.executor).write_rounds(job.share, rounds, job.codec,
                                                             job.level)
            save.pending = self.executor.written(job, chunks)
        else:
            pool = self.executor.pool_for(rounds[0].nbytes)
            try:
                arena = pool.acquire(rounds[0].nbytes)
            except CkptdError:  # the agent cannot hold it: this save and the next stage here
                if self.executor.alive:
                    raise
                pool = self.executor.pool_for(rounds[0].nbytes)
                arena = pool.acquire(rounds[0].nbytes)
            save.arena, save.pool = arena, pool
            if self.options.debug_overlap:
                buffer, plans = arena.tensor, rounds[0].plans
                save.handle._checks.append(lambda: check_unmodified(plans, buffer))
            # one file: nothing to overlap its staging with
            pipelined = (len(rounds[0].plans) > 1 and self.executor.pipelines
                         and config.pipelined_staging(self.options.threads))
            if not pipelined:  # every core copies first; then the files start
                stage(arena.buffer, rounds[0].plans)
            save.pending = self.executor.start(job, arena, pool, stage_first=pipelined)
        save.handle._mark_staged()

    def _abandon(self, save: _Save, error: BaseException) -> None:
        """A save that failed (or was interrupted) before the hand-off: no write may still read
        the arena when it goes back to the pool; its files go; the handle fails with the error
        that is raised to the caller right here."""
        for f in (save.pending.futures if save.pending is not None else None) or ():
            f.exception()
        if save.arena is not None and save.pool is not None:
            save.pool.release(save.arena)
        discard(self.storage, save.job)
        save.handle._mark_failed(error, reported=True)

    # ------------------------------------------------------------------ the save thread's half
    def _finish(self, save: _Save, stage_here: bool) -> None:
        """Stage (``overlap=True``); the executor carries the job to its end (files, partial,
        on rank 0 the commit); the other ranks wait for the commit, unless the executor saw it
        (the node agent that ran rank 0's job: ``Outcome.committed``); then the metrics
        line."""
        h, share, opts = save.handle, save.job.share, self.options
        taken = False  # the executor holds the job: it records and cleans up its failures
        try:
            if stage_here:
                self._stage(save)
            taken = True
            assert save.pending is not None
            t_staged = time.perf_counter()
            out = self.executor.finish(save.pending)
            if out.handed_to is not None:  # a peer's agent commits (on rank 0) or writes it
                h._mark_handed(out.handed_to)
                commit.wait_committed(self.storage, share.step, share.attempt, self.signals)
            elif opts.rank != 0 and not out.committed:
                self._wait_committed(save)
            result = SaveResult(share.step, h.url, out.nbytes, h.stall_s,
                                time.perf_counter() - t_staged, out.handed_to,
                                waited_s=h.waited_s, executor=out.executor)
            self._record(result)
            h._mark_committed(result)
        except exiting.Abandoned as e:  # the process exits: others may still finish it
            log.warning("ckptd: %s", e)
            h._mark_failed(e, reported=True)  # said once, here
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            # raised once, by the next save_async()/wait()/close() (or logged at exit when no
            # call comes): not also logged here
            h._mark_failed(e)
            # best effort, after the error is delivered (an unreachable store retries every
            # request); this thread still finishes it before the next save
            if not taken:  # it failed before the executor took it: tell the others
                failures.record_failure(self.storage, self.signals, share.step, share.attempt,
                                      opts.rank, e)
                discard(self.storage, save.job)

    def _wait_committed(self, save: _Save) -> None:
        """A rank other than 0: wait for the coordinator's commit. If the step failed for good
        (another rank's failure: a full disk, say), this rank's share, written and in no
        commit's reach, goes — it would otherwise fill the disk the next save needs."""
        share = save.job.share
        try:
            commit.wait_committed(self.storage, share.step, share.attempt, self.signals)
        except exiting.Abandoned:
            raise
        except BaseException:
            if failures.attempt_failed(self.storage, share.step, share.attempt, self.signals):
                discard(self.storage, save.job, partial=True)
            raise
        assert save.pending is not None
        self.executor.saw_commit(save.pending)

    def _record(self, r: SaveResult) -> None:
        if self.options.rank != 0 and not log.isEnabledFor(logging.INFO):
            return  # nothing to say: no line made (every rank, every save)
        line = {"step": r.step, "rank": self.options.rank,
                "world_size": self.options.world_size, "nbytes": r.nbytes,
                "stall_s": round(r.stall_s, 6), "write_s": round(r.write_s, 6),
                "wait_s": round(r.waited_s, 6), "executor": r.executor,
                "time": time.time()}
        text = json.dumps(line)
        log.info("ckptd save %s", text)
        if self.options.rank == 0:
            try:
                self.storage.append_text(layout.METRICS, text + "\n")
            except OSError as e:
                log.warning("ckptd: could not append metrics: %s", e)

    # ------------------------------------------------------------------ waiting
    def raise_pending(self) -> None:
        """Raise the first background error not yet raised to the caller."""
        for h in self._handles:
            err = h._take_error()
            if err is not None:
                raise err

    def wait(self) -> None:
        """Every in-flight save done; raise the first background error."""
        for h in list(self._handles):
            h._wait_done()
        self.raise_pending()

    def close(self) -> None:
        """Drain, settle the retention owed, then stop the save thread (raises a pending
        background error)."""
        try:
            self.wait()
            # every job is done: the retention owed, whoever runs the jobs (not after an exit
            # on an error: a job abandoned then may still run in the node agent)
            if not exiting.active():
                self._thread.submit(self.executor.settle).result()
        finally:
            self._thread.shutdown(wait=True)


def _in_process(executor: Executor) -> InProcess:
    """The in-process executor behind ``executor`` (saves over the host budget are written by
    this process, round by round, whoever runs the other saves)."""
    return executor if isinstance(executor, InProcess) else executor.fallback  # type: ignore[attr-defined, no-any-return]


def _replicas(described: Described) -> dict[str, int]:
    """The tensors of which this rank holds one of several copies, and how many copies."""
    out: dict[str, int] = {}
    for p in described.pieces:
        if p.replicas > 1:
            out[p.name] = max(out.get(p.name, 0), p.replicas)
    return out


def _json_copy(value: Any) -> Any:
    """A snapshot of JSON-able values, taken at the call (the caller may change them after)."""
    return json.loads(json.dumps(value))


__all__ = ["Saver", "SaveOptions"]
