"""The node agent as a Saver's executor (:class:`ckptd.writer.executor.Executor`): the arena
is the agent's shared memory and, once staged, the job goes to the agent before
``save_async`` returns; files, partial and, on rank 0, the commit then happen there
(:func:`ckptd.writer.job.run`, in the agent's process) and survive this one.

A save whose rank stages fewer than ``$CKPTD_AGENT_MIN_BYTES`` (default 1 MiB) stays in
this process: it stages into the fallback's memory and the fallback writes it. For such a save
the agent's fixed work (a message each way, its own hand-offs between threads, one interpreter
for the node's ranks) costs more than writing it here, and twice as much on a busy node
(``docs/agent.md``, *Tradeoffs*); the commit protocol goes through storage, so the ranks of a
step may be written by either.

If the agent is lost (it died, stopped answering, or cannot hold an arena), the job in flight
is finished here from the same arena, still mapped here — only its commit if the agent's
partial shows its files are written — and every later job runs in process (the executor's
``fallback``, with its own staging memory). A stopping agent may hand a save to a peer's agent
(``handed_to``; ``docs/agent.md``).
"""

from __future__ import annotations

import logging
import time

from ckptd.agent import jobs
from ckptd.agent.client import AgentClient, AgentLost
from ckptd.errors import CkptdError
from ckptd.manifest import layout
from ckptd.storage import Storage
from ckptd.writer import exiting, failures
from ckptd.writer.executor import InProcess, Outcome, Pending
from ckptd.writer.files import ChunkList
from ckptd.writer.group_store import GroupStore
from ckptd.writer.job import SaveJob
from ckptd.writer.staging import Arena, StagingPool

log = logging.getLogger("ckptd")


class AgentExecutor:
    """The node agent runs the jobs of one Saver; ``fallback`` once it is lost."""

    def __init__(self, client: AgentClient, fallback: InProcess, slots: int, rank: int,
                 min_bytes: int = 0) -> None:
        self.client, self.fallback, self.rank = client, fallback, rank
        self.storage: Storage = fallback.storage
        self.signals: GroupStore = fallback.signals
        # the arenas it may hold besides the one being staged: the kept steps, one being
        # copied to a peer, one a load (another process's, perhaps) is reading
        self._pool = StagingPool(slots + client.keep + int(client.peers) + 1,
                                 allocate=client.allocate)
        client.on_release = self._pool.release_buffer
        self.spare_arenas = client.keep + int(client.peers)
        self.min_bytes = min_bytes  # a smaller save is written here ($CKPTD_AGENT_MIN_BYTES)
        self._lost: BaseException | None = None

    # ------------------------------------------------------------------ what the Saver sees
    @property
    def name(self) -> str:
        return "agent" if self.alive else "process"

    @property
    def alive(self) -> bool:
        if self._lost is None and not self.client.alive:  # found out by the client (an
            self._lose(self.client.lost or AgentLost("the node agent stopped"))  # arena refused)
        return self._lost is None

    @property
    def pipelines(self) -> bool:  # the agent takes a job once it is staged in full
        return not self.alive

    @property
    def pool(self) -> StagingPool:
        """Where the next save stages; the agent's arenas once it has answered the commits
        this process told it of (they may give one back)."""
        if self.alive:
            self._seen()
        return self._pool if self.alive else self.fallback.pool

    def pool_for(self, nbytes: int) -> StagingPool:
        """The agent's arenas, or this process's memory for a save under ``min_bytes``
        (:meth:`start` gives a save staged there to the fallback)."""
        return self.fallback.pool if nbytes < self.min_bytes else self.pool

    @property
    def hands_off(self) -> bool:
        return self.alive and self.client.peers

    # ------------------------------------------------------------------ jobs
    def start(self, job: SaveJob, arena: Arena, pool: StagingPool, *,
              stage_first: bool) -> Pending:
        if pool is not self._pool:  # staged in this process's memory: a small save, or
            # the agent was lost
            return self.fallback.start(job, arena, pool, stage_first=stage_first)
        if not self.alive:
            return self.fallback.start(job, arena, pool, stage_first=False)
        try:
            ticket = self.client.submit(arena.tensor, jobs.encode(job))
        except AgentLost as e:
            self._lose(e)
            return self.fallback.start(job, arena, pool, stage_first=False)
        return Pending(job, arena, pool, ticket=ticket, t_write=time.perf_counter())

    def written(self, job: SaveJob, chunks: ChunkList) -> Pending:
        return self.fallback.written(job, chunks)

    def finish(self, pending: Pending) -> Outcome:
        """Wait for the agent's part (files, partial and, on rank 0, the commit). If the agent
        was lost, carry on here: the files from the same arena, unless the agent's partial
        shows they are all written."""
        if pending.ticket is None:
            return self.fallback.finish(pending)
        job = pending.job
        share = job.share
        try:
            reply = exiting.result(pending.ticket.reply, time.monotonic(),
                                   f"step {share.step}: the node agent goes on with this "
                                   "rank's share without this process")
        except AgentLost as e:
            self._lose(e)
            partial = layout.partial_path(share.step, share.attempt, share.rank)
            pending.only_commit = self.storage.exists(partial)
            pending.ticket = None
            return self.fallback.finish(pending)  # (it gives the arena back)
        except exiting.Abandoned:
            _give_back(pending)
            raise
        except BaseException as e:  # the agent's failure: it recorded it (and cleaned up)
            _give_back(pending)
            failures.publish_recorded(self.storage, self.signals, share.step, share.attempt,
                                    share.rank, e)
            raise
        if not reply.get("kept"):  # (kept: the step stays in it; it says when it lets go)
            _give_back(pending)
        for ptr in reply.get("released", ()):
            self._pool.release_buffer(ptr)  # arenas of older steps it let go of
        if reply.get("warning"):
            log.warning("ckptd: node agent: %s", reply["warning"])
        handed = str(reply["handed_to"]) if reply.get("handed_to") else None
        if handed is None and self.fallback.auto is not None:
            self.fallback.auto.observe_write(int(reply["nbytes"]), float(reply["write_s"]),
                                             job.codec)
        if share.rank == 0 and handed is None:
            self.signals.publish_committed(share.attempt)  # the agent committed it
        # (another rank: rank 0's job in the same agent committed it, and the agent took
        # note — an agent that does not say so leaves the wait to the Saver)
        return Outcome(int(reply["nbytes"]), float(reply.get("write_s", 0.0)), handed,
                       committed=handed is None and reply.get("committed") is True,
                       executor="agent")

    def saw_commit(self, pending: Pending) -> None:
        """The agent keeps a step it wrote but did not commit beside the committed one until
        it hears of the commit (``docs/agent.md``); of a step written here it hears
        nothing."""
        if not self.alive or pending.ticket is None:
            return
        share = pending.job.share
        try:
            self.client.saw_commit(share.rank, share.step)  # answered later: _seen
        except CkptdError as e:  # lost: it holds nothing any more
            log.warning("ckptd: the node agent did not take note of step %d's commit: %s",
                        share.step, e)

    def _seen(self) -> None:
        """The agent's answers to :meth:`saw_commit`, waited for."""
        try:
            self.client.seen()
        except CkptdError as e:  # lost: it holds nothing any more
            log.warning("ckptd: the node agent did not take note of a commit: %s", e)

    def settle(self) -> None:
        """The retention the agent owes (after its last commit), and this process's."""
        self.fallback.settle()
        if self.alive:
            try:
                self.client.settle()
            except CkptdError as e:
                log.warning("ckptd: the node agent did not settle retention: %s", e)

    def close(self) -> None:
        if self.alive:
            self._seen()
        self.client.close()

    def _lose(self, error: BaseException) -> None:
        """Every later save runs in process (its own staging memory)."""
        if self._lost is None:
            self._lost = error
            log.warning("ckptd: rank %d: %s; saving in process from now on", self.rank, error)


def _give_back(pending: Pending) -> None:
    """The agent is done with the job's arena: the next save may stage into it."""
    if pending.arena is not None and pending.pool is not None:
        pending.pool.release(pending.arena)


__all__ = ["AgentExecutor"]
