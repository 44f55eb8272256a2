"""The Checkpointer: one root, one rank, its background pipeline.

``save_async`` describes the state (pieces), packs the writer pieces into an arena laid out like
the data files, copies them in (the stall) and hands the rest to a single driver thread
(:mod:`ckptd.writer.driver`): write the files in parallel, write the partial manifest, then
commit (coordinator) or wait for the commit (other ranks). No collectives happen after
``__init__`` on the save path.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ckptd import config
from ckptd.errors import CheckpointNotFound, CkptdError, CorruptCheckpoint
from ckptd.manifest import Manifest, TensorEntry, catalog, codecs
from ckptd.manifest import layout as L
from ckptd.reshard.load import load_into
from ckptd.sharding import describe
from ckptd.storage import Storage, open_storage
from ckptd.world import agree_run_id, dist_or_none, resolve_world
from ckptd.writer import commit as C
from ckptd.writer.autocodec import AutoCodec
from ckptd.writer.driver import Job, SaveDriver
from ckptd.writer.handle import Phase, SaveHandle, SaveResult, SkippedHandle
from ckptd.writer.pipeline import (
    RankWriter,
    Share,
    check_unmodified,
    n_files,
    plan_rounds,
    stage,
)
from ckptd.writer.signals import Signals
from ckptd.writer.staging import StagingPool

log = logging.getLogger("ckptd")

_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@dataclass(frozen=True)
class LoadResult:
    step: int
    url: str
    nbytes_read: int
    training: dict[str, Any]


class Checkpointer:
    """Checkpoints of one training job under ``root``.

    >>> ckpt = Checkpointer("/tmp/ckpts")                       # doctest: +SKIP
    >>> ckpt.save({"model": model.state_dict(), "step": 10})   # doctest: +SKIP
    """

    def __init__(
        self,
        root: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        keep_last: int = 3,
        compression: str | None = None,
        storage_options: dict[str, Any] | None = None,
        max_inflight: int = 1,
        threads: int | None = None,
        on_busy: str = "block",
        run_id: str | None = None,
        storage: Storage | None = None,
        debug_overlap: bool = False,
        host_budget_bytes: int | None = None,
        read_only: bool = False,
    ) -> None:
        if on_busy not in ("block", "skip"):
            raise ValueError(f"on_busy must be 'block' or 'skip', got {on_busy!r}")
        self.rank, self.world_size = resolve_world(rank, world_size)
        self.storage = storage if storage is not None else open_storage(root, storage_options)
        self.url = self.storage.url
        self.keep_last = keep_last
        self.auto = AutoCodec(self.threads_for(threads)) if compression == "auto" else None
        self.codec, self.level = codecs.parse_compression(None if self.auto else compression)
        self.max_inflight = max(1, max_inflight)
        self.on_busy = on_busy
        self.threads = self.threads_for(threads)
        self.debug_overlap = debug_overlap or os.environ.get("CKPTD_DEBUG_OVERLAP") == "1"
        self.run_id = agree_run_id(self.rank, self.world_size, run_id)
        self.host_budget_bytes = host_budget_bytes
        self.pool = StagingPool(self.max_inflight)
        self._io = ThreadPoolExecutor(self.threads, thread_name_prefix="ckptd-io")
        self._writer = RankWriter(self.storage, self._io, self.pool, self.codec, self.level)
        self._background = SaveDriver(self.storage, self._writer, self.pool, self.auto, self.rank,
                                      self.world_size, self.run_id, self.keep_last,
                                      Signals.from_process_group())
        self._driver = ThreadPoolExecutor(1, thread_name_prefix="ckptd-save")
        self._handles: list[SaveHandle] = []
        self._seq = 0
        self._last_step: int | None = None
        self._closed = False
        self._lock = threading.Lock()
        # A writer takes the root over (a job still writing under the previous owner fails its
        # next commit); a reader (an evaluation job, a tool) must not, or it would stop the
        # training job that owns the root.
        self.read_only = read_only
        if self.rank == 0 and not read_only:
            self._background.generation = C.claim(self.storage, self.run_id)
        _live.add(self)

    @staticmethod
    def threads_for(threads: int | None) -> int:
        return threads or config.io_threads()

    # ------------------------------------------------------------------ saving
    def save_async(
        self,
        state: Any,
        *,
        step: int | None = None,
        overlap: bool = False,
        training: dict[str, Any] | None = None,
        urgent: bool = False,
        overwrite: bool = False,
    ) -> SaveHandle:
        """Stage ``state`` into host memory and write it in the background.

        Returns once the state is staged: the caller may then modify every tensor. With
        ``overlap=True`` it returns at once and stages in the background; call
        ``handle.wait_staged()`` before modifying the state. ``urgent=True`` (the preemption
        save) writes this step uncompressed whatever ``compression`` says, through the same
        staging buffers and I/O threads. A committed step is immutable: saving its number again
        fails (on every rank) unless ``overwrite=True``.
        """
        self._check_open()
        if self.read_only:
            raise CkptdError(f"{self.url}: this Checkpointer is read-only (read_only=True)")
        self._raise_pending()
        t0 = time.perf_counter()
        step = self._next_step(state, step)
        inflight = [h for h in self._handles if not h.done()]
        if len(inflight) >= self.max_inflight:
            if self.on_busy == "skip":
                log.warning(
                    "ckptd: step %d skipped: %d save(s) still in flight", step, len(inflight)
                )
                return SkippedHandle(step, self.url)
            for h in inflight[: len(inflight) - self.max_inflight + 1]:
                h._committed.exception()  # wait; errors surface through _raise_pending
            self._raise_pending()
        self._seq += 1
        described = describe(state, self.rank, self.world_size)
        share = Share(
            step=step,
            attempt=f"{self.run_id}-{self._seq:06d}",
            rank=self.rank,
            world_size=self.world_size,
            declared={p.name: TensorEntry(p.dtype, p.global_shape) for p in described.pieces},
            values=_json_copy(described.values) if self.rank == 0 else {},
            locals=_json_copy(
                {k: v for k, v in described.locals.items() if not isinstance(v, torch.Tensor)}
            ),
            training=_json_copy(training or {}),
        )
        rounds = plan_rounds(
            [p for p in described.pieces if p.is_writer], self.threads, self.host_budget_bytes
        )
        if len(rounds) > 1 and overlap:
            raise CkptdError(
                f"step {step}: overlap=True needs the state staged at once, but it needs "
                f"{sum(r.nbytes for r in rounds)} bytes and the host budget is "
                f"{self.host_budget_bytes}"
            )
        handle = SaveHandle(step, f"{self.url}/{L.step_dir(step)}")
        self._handles = [h for h in self._handles if not h.done()] + [handle]
        self._last_step = step
        codec = codecs.RAW if urgent else self.auto.choose() if self.auto else self.codec
        job = Job(share, rounds, handle, codec, overwrite=overwrite)
        submitted = False
        try:
            self._start(job, overlap, t0)
            self._driver.submit(self._background.run, job)
            submitted = True
        except BaseException as e:  # Ctrl-C included: the exit drain must not wait on it
            if not submitted:
                self._abandon(job, e)
            raise
        if overlap:
            handle.stall_s = time.perf_counter() - t0
        return handle

    def _start(self, job: Job, overlap: bool, t0: float) -> None:
        """Stage (unless ``overlap``) and start the file writes of one save."""
        handle, share, rounds = job.handle, job.share, job.rounds
        if len(rounds) > 1:
            log.warning(
                "ckptd: step %d needs %d bytes of staging, over the host budget of %d: "
                "writing it in %d blocking rounds",
                share.step,
                sum(r.nbytes for r in rounds),
                self.host_budget_bytes,
                len(rounds),
            )
            job.chunks = self._writer.write_rounds(share, rounds, codec=job.codec)
            handle.stall_s = time.perf_counter() - t0
            handle._set_staged()
            return
        job.arena = self.pool.acquire(rounds[0].nbytes)
        if self.debug_overlap:
            arena_buf, plans = job.arena.buffer, rounds[0].plans
            handle.on_wait_staged.append(lambda: check_unmodified(plans, arena_buf))
        if not overlap:
            job.t_write = time.perf_counter()
            pipelined = config.pipelined_staging(self.threads)
            if not pipelined:  # every core copies first; then the writers start
                stage(job.arena.buffer, rounds[0].plans)
            job.futures = self._writer.start_files(
                share, job.arena, rounds[0], 0, stage_first=pipelined, codec=job.codec
            )
            handle.stall_s = time.perf_counter() - t0
            handle._set_staged()

    def _abandon(self, job: Job, error: BaseException) -> None:
        """A save that failed (or was interrupted) before its background half was handed over:
        no write may still read the arena when it goes back to the pool; its files go; the
        handle fails and the error is raised right here, to the caller."""
        for f in job.futures or ():
            f.exception()
        if job.arena is not None:
            self.pool.release(job.arena)
        self._writer.discard(job.share, n_files(job.rounds))
        job.handle._set_failed(error)
        job.handle._reported = True

    def reserve(self, state: Any) -> int:
        """Allocate (and fault in) the staging memory ``state`` will need, ahead of the first
        save, so that save's stall is one copy rather than one copy plus page faults (0.5-2.6 s
        for 2 GiB here). Returns the bytes reserved."""
        described = describe(state, self.rank, self.world_size)
        rounds = plan_rounds(
            [p for p in described.pieces if p.is_writer], self.threads, self.host_budget_bytes
        )
        need = max(r.nbytes for r in rounds)
        self.pool.release(self.pool.acquire(need))
        return need

    def save(
        self,
        state: Any,
        *,
        step: int | None = None,
        training: dict[str, Any] | None = None,
        urgent: bool = False,
        overwrite: bool = False,
    ) -> SaveResult:
        """``save_async(...).result()``: returns once committed on every rank."""
        return self.save_async(
            state, step=step, training=training, urgent=urgent, overwrite=overwrite
        ).result()

    def _next_step(self, state: Any, step: int | None) -> int:
        if step is not None:
            return int(step)
        if (
            isinstance(state, dict)
            and isinstance(state.get("step"), int)
            and not isinstance(state.get("step"), bool)
        ):
            return int(state["step"])
        if self._last_step is not None:
            return self._last_step + 1
        latest = self.latest_step()
        return 0 if latest is None else latest + 1

    def _raise_pending(self) -> None:
        for h in self._handles:
            err = h._take_error()
            if err is not None:
                raise err

    def wait(self) -> None:
        """Block until every in-flight save is committed; raise the first background error."""
        for h in list(self._handles):
            h._committed.exception()
        self._raise_pending()

    def close(self) -> None:
        """Drain in-flight saves, stop the threads; raises a pending background error."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._driver.shutdown(wait=True)
            self._io.shutdown(wait=True)
            _live.discard(self)

    def _check_open(self) -> None:
        if self._closed:
            raise CkptdError("this Checkpointer is closed")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ reading
    def latest_step(self) -> int | None:
        """Newest committed step under the root, in commit order (``docs/format.md``): a newer
        owner's steps win over an older owner's whatever their numbers. Never commits
        anything."""
        last = catalog.newest(self.storage)
        return None if last is None else last.step

    def read_manifest(self, step: int) -> Manifest:
        return catalog.read_manifest(self.storage, step)

    def load(
        self,
        state: Any,
        *,
        step: int | None = None,
        strict: bool = True,
        source: str | None = None,
        trust: bool = False,
    ) -> LoadResult:
        """Fill ``state`` in place from a committed step (resharding to its layout).

        ``source`` loads from another checkpoint instead of this root: a
        torch.distributed.checkpoint directory (its pickled ``.metadata`` is only read with
        ``trust=True``)."""
        self._check_open()
        if source is not None or self.storage.exists(L.DCP_METADATA):
            from ckptd.interop.dcp import load_from_dcp  # lazy: only DCP sources need it

            dcp = load_from_dcp(self, state, source=source, step=step, strict=strict, trust=trust)
            if dcp is not None:
                return dcp
        if step is not None:
            try:
                return self._load_step(state, step, strict)
            except CorruptCheckpoint as e:  # its manifest was read: was it removed since?
                if self._rotated_away(step):
                    raise CheckpointNotFound(
                        f"{self.url}/{L.step_dir(step)}: removed while it was being read "
                        "(retention keeps only the newest steps: load a newer one)"
                    ) from e
                raise
        for last_try in (False, True):
            newest = self._agreed_latest()
            if newest is None:
                raise CheckpointNotFound(f"{self.url}: no committed checkpoint")
            try:
                return self._load_step(state, newest, strict)
            except (CorruptCheckpoint, CheckpointNotFound):
                if last_try or not self._rotated_away(newest):
                    raise
                log.warning("ckptd: step %d was removed by retention while being read; "
                            "loading the newest step", newest)
        raise AssertionError("unreachable")

    def _load_step(self, state: Any, step: int, strict: bool) -> LoadResult:
        manifest = self.read_manifest(step)
        described = describe(state, self.rank, self.world_size)
        nbytes = load_into(
            self.storage,
            L.step_dir(step),
            manifest,
            described,
            rank=self.rank,
            world_size=self.world_size,
            strict=strict,
            pool=self._io,
        )
        self._last_step = max(self._last_step or step, step)
        return LoadResult(step, f"{self.url}/{L.step_dir(step)}", nbytes, dict(manifest.training))

    def _rotated_away(self, step: int) -> bool:
        """Whether ``step`` stopped being committed (retention uncommits before it deletes, so
        every rank that sees a missing data file afterwards also sees the manifest gone)."""
        try:
            return not self.storage.exists(L.manifest_path(step))
        except OSError:
            return False

    def _agreed_latest(self) -> int | None:
        dist = dist_or_none()
        if dist is None or dist.get_world_size() == 1:
            return self.latest_step()
        box = [self.latest_step() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _json_copy(value: Any) -> Any:
    """A snapshot of JSON-able values, taken at the call (the caller may change them after)."""
    return json.loads(json.dumps(value))


def _drain_at_exit() -> None:
    for ckpt in list(_live):
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001 - exiting anyway; say why
            log.error("ckptd: a save did not complete before exit: %s", e)


# Drain before concurrent.futures refuses new work at interpreter exit: its hook is registered
# with threading's exit hooks, which run before atexit's and in reverse order of registration.
try:
    threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - other Pythons
    atexit.register(_drain_at_exit)


__all__ = ["Checkpointer", "LoadResult", "SaveHandle", "SaveResult", "Phase"]
