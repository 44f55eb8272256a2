"""A Saver's side of the node agent (:mod:`ckptd.agent`): hand a staged save over, learn how
the agent's part ended, and fall back to saving in process when the agent is lost.

With an :class:`~ckptd.writer.remote.Offload` the arena is the agent's shared memory and, once
staged, the job is handed to the agent before ``save_async`` returns: files, partial and commit
then happen there, and survive this process. If the agent is lost, the save thread writes the
same arena (still mapped here) itself, and every later save runs in process. A stopping agent
may hand the save to a peer's agent (``handed_to``; ``docs/agent.md``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ckptd import config
from ckptd.errors import CkptdError
from ckptd.manifest import layout
from ckptd.storage import Storage
from ckptd.writer import exiting, remote
from ckptd.writer.autocodec import AutoCodec
from ckptd.writer.files import Framing
from ckptd.writer.pipeline import RankWriter, stage
from ckptd.writer.remote import AgentLost, Offload
from ckptd.writer.staging import StagingPool

if TYPE_CHECKING:
    from ckptd.writer.save import SaveOptions, _Job

log = logging.getLogger("ckptd")


class AgentHandover:
    """The node agent's half of :class:`~ckptd.writer.save.Saver` (a base class of it)."""

    storage: Storage
    options: SaveOptions
    offload: Offload | None
    pool: StagingPool
    max_inflight: int
    auto: AutoCodec | None
    generation: int
    _writer: RankWriter
    _local_pool: StagingPool | None  # set once the agent is lost

    def _hand_over(self, job: _Job) -> bool:
        """Stage the whole round and give the job to the agent; False when there is no agent
        (or it was lost, then the files are started here from the same arena)."""
        if self.offload is None or self._local_pool is not None:
            return False
        if not self.offload.alive:
            self._agent_lost(AgentLost("the node agent stopped"))
            return False
        assert job.arena is not None
        rnd = job.rounds[0]
        stage(job.arena.buffer, rnd.plans)
        opts = self.options
        doc = remote.encode(
            job.share, rnd, codec=job.codec, level=self._writer.level,
            framing=Framing.current(),
            commit_=remote.Commit(opts.run_id, self.generation, job.overwrite, opts.keep_last,
                                  opts.incarnation, config.get().commit_timeout_s))
        try:
            job.ticket = self.offload.submit(job.arena.tensor, doc)
        except AgentLost as e:
            self._agent_lost(e)
            job.futures = self._writer.start_files(job.share, job.arena, rnd, 0,
                                                   stage_first=False, codec=job.codec)
        return True

    @property
    def hands_off(self) -> bool:
        """Whether a save this rank's node cannot write inside a SIGTERM's grace window may go
        to a peer's agent (the node agent runs with peers)."""
        return (self.offload is not None and self._local_pool is None and self.offload.alive
                and self.offload.peers)

    def _agent_lost(self, error: BaseException) -> None:
        """Every later save runs in process (its own staging memory)."""
        if self._local_pool is None:
            log.warning("ckptd: rank %d: %s; saving in process from now on",
                        self.options.rank, error)
            self._local_pool = self.pool = StagingPool(self.max_inflight)
            self._writer.pool = self._local_pool

    def _finish_on_agent(self, job: _Job) -> int | None:
        """Wait for the agent's part (files, partial and, on rank 0, the commit). Its stored
        bytes; or None when the agent was lost and this thread must carry on: then the files
        are started here from the same arena, unless the agent's partial shows they are all
        written."""
        assert job.ticket is not None and job.arena is not None
        share = job.share
        try:
            reply = exiting.result(job.ticket.reply, time.monotonic(),
                                   f"step {share.step}: the node agent goes on with this "
                                   "rank's share without this process")
        except AgentLost as e:
            self._agent_lost(e)
            partial = layout.partial_path(share.step, share.attempt, share.rank)
            if not self.storage.exists(partial):
                job.futures = self._writer.start_files(share, job.arena, job.rounds[0], 0,
                                                       stage_first=False, codec=job.codec)
            return None
        if reply.get("handed_to"):  # the agent was stopping: a peer's agent writes it
            job.handle.mark_handed(str(reply["handed_to"]))
        elif self.auto is not None:
            self.auto.observe_write(int(reply["nbytes"]), float(reply["write_s"]), job.codec)
        job.kept = bool(reply.get("kept"))
        if reply.get("warning"):
            log.warning("ckptd: node agent: %s", reply["warning"])
        if job.pool is not None:
            for ptr in reply.get("released", ()):
                job.pool.release_buffer(ptr)
        return int(reply["nbytes"])


    def _tell_committed(self, rank: int, step: int) -> None:
        """The agent keeps a step it wrote but did not commit beside the committed one until
        it hears of the commit (``docs/agent.md``)."""
        assert self.offload is not None
        try:
            self.offload.committed(rank, step)
        except CkptdError as e:  # lost: it holds nothing any more
            log.warning("ckptd: the node agent did not take note of step %d's commit: %s", step, e)


__all__ = ["AgentHandover"]
