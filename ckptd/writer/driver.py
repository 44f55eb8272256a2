"""The background half of a save, on the checkpointer's single driver thread.

``Checkpointer.save_async`` stages the state and starts the file writes (a :class:`Job`);
:meth:`SaveDriver.run` finishes them, writes the rank's partial manifest, commits (the
coordinator, rank 0) or waits for the commit (the other ranks), applies retention and appends
the save's line to ``metrics.jsonl``. No collectives: every rank's driver works alone.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from ckptd.manifest import Chunk
from ckptd.manifest import layout as L
from ckptd.storage import Storage
from ckptd.storage.base import append_text
from ckptd.writer import commit as C
from ckptd.writer import retention
from ckptd.writer.autocodec import AutoCodec, largest_float_slot
from ckptd.writer.files import gather
from ckptd.writer.handle import Phase, SaveHandle, SaveResult
from ckptd.writer.pipeline import RankWriter, Round, Share, n_files, stage, stored_bytes
from ckptd.writer.signals import Signals
from ckptd.writer.staging import Arena, StagingPool

log = logging.getLogger("ckptd")


@dataclass
class Job:
    """One save between ``save_async`` and its commit."""

    share: Share
    rounds: list[Round]
    handle: SaveHandle
    codec: str  # this save's codec (compression="auto" chooses per save; urgent saves are raw)
    overwrite: bool = False  # replace the step if it is already committed
    arena: Arena | None = None  # one round: staged in an arena, written in the background
    chunks: list[tuple[str, Chunk]] = field(default_factory=list)
    futures: list[Future[list[tuple[str, Chunk]]]] | None = None  # files already being written
    t_write: float = float("inf")  # when the first file was handed to an I/O thread


@dataclass
class SaveDriver:
    """What the background half needs of its checkpointer."""

    storage: Storage
    writer: RankWriter
    pool: StagingPool
    auto: AutoCodec | None
    rank: int
    world_size: int
    run_id: str
    keep_last: int
    signals: Signals = field(default_factory=lambda: Signals(None))
    generation: int = 0  # the coordinator's, from its claim of the root

    def run(self, job: Job) -> None:
        """Write (if not written yet), the partial manifest, commit; then retention."""
        h, share = job.handle, job.share
        partial_written = False
        try:
            t_staged = time.perf_counter()
            if job.arena is not None:
                try:
                    if h.phase is Phase.STAGING:  # overlap=True: stage here
                        stage(job.arena.buffer, job.rounds[0].plans)
                        t_staged = time.perf_counter()
                        h._set_staged()
                    t_write = time.perf_counter()
                    if job.futures is not None:
                        job.chunks = gather(job.futures)
                    else:
                        job.chunks = self.writer.write_round(
                            share, job.arena, job.rounds[0], 0, job.codec
                        )
                    if self.auto is not None:
                        self._observe(job, time.perf_counter() - min(t_write, job.t_write))
                finally:
                    self.pool.release(job.arena)
            self.writer.write_partial(share, job.chunks)
            partial_written = True
            if self.rank == 0:
                C.coordinate(self.storage, share.step, share.attempt, self.world_size,
                             self.run_id, generation=self.generation, overwrite=job.overwrite,
                             signals=self.signals)
            else:
                C.wait_committed(self.storage, share.step, share.attempt, self.signals)
            result = SaveResult(
                share.step,
                h.url,
                stored_bytes(job.chunks),
                h.stall_s,
                time.perf_counter() - t_staged,
            )
            self._record(result)
            h._set_committed(result)
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            log.error("ckptd: save of step %d failed: %s", share.step, e)
            h._set_failed(e)
            # best effort, after the error is delivered (an unreachable store retries every
            # request); the single driver thread still finishes it before the next save
            if not partial_written:  # once a partial names them, a commit may still use them
                # this rank's share failed: tell the others, or they wait for the timeout
                C.record_failure(self.storage, self.signals, share.step, share.attempt,
                                 self.rank, e)
                self.writer.discard(share, n_files(job.rounds))
            return
        if self.rank == 0 and self.keep_last > 0:
            # After the commit is announced: deleting a large old step takes a while (0.3-0.6 s
            # for 2 GiB here) and must not delay "committed"; the driver finishes it before the
            # next save's background work.
            try:
                retention.apply_retention(self.storage, self.keep_last)
            except OSError as e:
                log.warning("ckptd: retention after step %d failed: %s", share.step, e)

    def _observe(self, job: Job, seconds: float) -> None:
        """Feed compression="auto" with this save's write bandwidth and a compressor sample."""
        assert self.auto is not None and job.arena is not None
        self.auto.observe_write(stored_bytes(job.chunks), seconds, job.codec)
        slots = [(s.piece.view, s.offset, s.nbytes) for p in job.rounds[0].plans for s in p.slots]
        best = largest_float_slot(slots)
        if best is not None and self.auto.zstd_bps is None:
            offset, nbytes, itemsize = best
            mem = memoryview(job.arena.buffer.numpy()).cast("B")  # type: ignore[arg-type]
            self.auto.observe_sample(mem[offset : offset + nbytes], itemsize)
        log.info(
            "ckptd: compression=auto: write %.2f GB/s, zstd %.2f GB/s/thread, ratio %.2f -> %s",
            (self.auto.write_bps or 0) / 1e9,
            (self.auto.zstd_bps or 0) / 1e9,
            self.auto.ratio or 0,
            self.auto.choose(),
        )

    def _record(self, r: SaveResult) -> None:
        line = {
            "step": r.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "nbytes": r.nbytes,
            "stall_s": round(r.stall_s, 6),
            "write_s": round(r.write_s, 6),
            "time": time.time(),
        }
        log.info("ckptd save %s", json.dumps(line))
        if self.rank == 0:
            try:
                append_text(self.storage, L.METRICS, json.dumps(line) + "\n")
            except OSError as e:
                log.warning("ckptd: could not append metrics: %s", e)
