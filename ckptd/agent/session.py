"""One client of the node agent (a Checkpointer of one rank): its requests, its segments, its
jobs in order (``docs/agent.md``). A session's jobs run to the end when its trainer dies."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ckptd import config
from ckptd.agent import jobs, wire
from ckptd.agent.core import AgentCore, Flight
from ckptd.agent.holdings import HeldStep
from ckptd.agent.orphans import JobKey
from ckptd.agent.shm import Segment
from ckptd.agent.wire import root_key
from ckptd.manifest import codecs
from ckptd.writer import retention
from ckptd.writer.executor import Inline, writes_inline
from ckptd.writer.group_store import GroupStore
from ckptd.writer.job import Interrupted, SaveJob, run

if TYPE_CHECKING:
    from ckptd.agent.replication import Outgoing

log = logging.getLogger("ckptd.agent")


def nice() -> int:
    """``$CKPTD_AGENT_NICE`` (default 10): how far the agent's writing yields to training."""
    return max(0, config.AGENT_NICE.get())


def background() -> None:
    """Run this thread (a writer's) at ``nice()`` within the agent: its session and heartbeat
    threads keep niceness 0, so it answers at once while it writes (Linux niceness is per
    thread). It does not lower the agent's share against the trainers: with autogroups (on by
    default) CPU time is shared between sessions first, and the agent has a session of its own.
    Niceing that autogroup too starved the heartbeats under load (``docs/agent.md``,
    *Tradeoffs*)."""
    if nice() > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice())
        except OSError as e:  # not Linux, or not allowed: the default priority
            log.info("ckptd agent: writer threads keep their priority (%s)", e)


def job_step_key(msg: dict[str, Any]) -> tuple[str, int, str]:
    """The root, step and attempt of a ``save`` message's job (:mod:`ckptd.agent.commits`)."""
    share = msg["job"]["share"]
    return root_key(msg["storage"]), int(share["step"]), str(share["attempt"])


class Session:
    """One client (a Checkpointer of one rank): its segments, its jobs in order."""

    def __init__(self, agent: AgentCore, conn: socket.socket, pid: int) -> None:
        self.agent, self.conn, self.pid = agent, conn, pid
        self.segments: dict[int, Segment] = {}
        self._send_lock = threading.Lock()
        self._open = True
        self._jobs = ThreadPoolExecutor(1, thread_name_prefix=f"ckptd-job-{pid}",
                                        initializer=background)
        self._io: ThreadPoolExecutor | None = None
        self._next_segment = 0
        self._leases: dict[int, list[HeldStep]] = {}  # loads reading kept steps
        self._retention = retention.Owed()  # after rank 0's commit, settled by its next save
        # the segments that jobs queued or running still use (the trainer may die meanwhile:
        # then the job, not the session's end, decides whether its arena is kept or removed)
        self._in_use: dict[int, int] = {}
        self._ended = False
        self._state = threading.Lock()
        self._next_lease = 0
        self.root = ""  # the root its saves go to, and whose trainer it is (from its hello)
        self.trainer: tuple[str, int] | None = None  # (incarnation, rank)

    def reply(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            if not self._open:
                return
            try:
                wire.send(self.conn, msg)
            except OSError:
                self._open = False  # the trainer is gone; its jobs go on

    def serve(self) -> None:
        beat = threading.Thread(target=self._heartbeat, daemon=True)
        beat.start()
        try:
            while True:
                try:
                    msg = wire.recv(self.conn)
                except (ConnectionError, OSError, ValueError):
                    return
                try:
                    self._handle(msg)
                except Exception as e:  # noqa: BLE001 - a bad request fails that request
                    log.warning("ckptd agent: request from pid %d failed: %s", self.pid, e)
                    self.reply(wire.failure(msg.get("id"), e))
        finally:
            with self._send_lock:
                self._open = False
            self.conn.close()
            for pinned in self._leases.values():
                for k in pinned:
                    self.agent.holdings.pin(k, -1)
            with self._state:
                self._ended = True
                in_use = set(self._in_use)
            self.agent.holdings.orphan(self)
            for seg_id, seg in self.segments.items():  # names go, but not under a job
                if seg_id not in in_use and not self.agent.holdings.is_kept(seg):
                    self.agent.holdings.forget(seg)
            self._jobs.submit(self._settle_retention)  # after the jobs still queued
            self._jobs.shutdown(wait=False)  # queued jobs still run; then the session is gone
            if self.trainer is not None:
                self.agent.shares.connected(*self.trainer, -1)
            self.agent.session_ended(self)

    def _heartbeat(self) -> None:
        while self._open:  # also while stopping: the trainer's last saves still come
            self.reply({"op": "alive"})
            time.sleep(wire.HEARTBEAT_S)

    def _handle(self, msg: dict[str, Any]) -> None:
        op, rid = msg.get("op"), msg.get("id")
        if op == "hello":
            if self.agent.upkeep.retiring is not None:
                self.reply({"id": rid, "op": "refused", "pid": os.getpid(),
                            "error": f"the node agent (pid {os.getpid()}) is retiring "
                                     f"({self.agent.upkeep.retiring})"})
                return
            spec = msg.get("storage") or {}
            if spec.get("url"):  # (``ckptd agent --status`` names no root)
                wire.check_root(spec["url"])
            self.root = root_key(spec)
            if self.trainer is None and msg.get("run") is not None:
                self.trainer = (str(msg["run"]), int(msg["rank"]))
                self.agent.shares.connected(*self.trainer, +1)
            if self.agent.peer_side.replicator is not None and spec.get("url"):
                # announced before the first save, so that every node's first copy finds its
                # peers
                self.agent.peer_side.replicator.register(self.agent.storage(spec))
            threads = max(1, int(msg.get("threads", config.io_threads())))
            if self._io is None:
                self._io = ThreadPoolExecutor(threads, thread_name_prefix=f"ckptd-aio-{self.pid}",
                                              initializer=background)
            self.reply({"id": rid, "op": "hello", "pid": os.getpid(), "node": self.agent.node,
                        "version": jobs.VERSION, "identity": wire.identity(),
                        "keep": self.agent.keep_in_memory,
                        "peers": self.agent.peer_side.replicator is not None,
                        "budget": self.agent.holdings.budget, "log": self.agent.paths["log"],
                        "idle_exit_s": self.agent.idle_exit_s,
                        "release_s": self.agent.upkeep.release_s})
        elif op == "arena":
            nbytes = int(msg["nbytes"])
            self._next_segment += 1
            seg = self.agent.holdings.create(nbytes, self.agent.tag(str(self.pid)))
            self.segments[self._next_segment] = seg
            self.reply({"id": rid, "op": "arena", "segment": self._next_segment,
                        "path": seg.path})
        elif op == "free":
            freed = self.segments.pop(int(msg["segment"]), None)  # a job using it holds it
            if freed is not None and not self.agent.holdings.is_kept(freed):
                self.agent.holdings.forget(freed)
        elif op == "save":
            # the trainer does not wait for an answer: a job that does not decode fails
            # through its "failed" reply
            seg = self.segments[int(msg["segment"])]
            job = JobKey.of(msg["storage"], msg["job"])
            # rank 0's: this agent coordinates, and tells its node's other ranks how it went
            # (registered before the job counts as started: a waiter that sees it running
            # finds its outcome)
            outcome = (self.agent.commits.expect(job_step_key(msg))
                       if msg["job"]["share"].get("rank") == 0 else None)
            self.agent.job_started(job)
            with self._state:
                self._in_use[int(msg["segment"])] = self._in_use.get(int(msg["segment"]), 0) + 1
            try:
                self._jobs.submit(self._run, int(msg["id"]), job, msg, int(msg["segment"]),
                                  outcome)
            except BaseException:
                if outcome is not None:
                    outcome.set_result(False)  # never runs: nobody waits for it
                raise
        elif op == "drain":  # a restarted job waits for its predecessor's saves to finish
            # and they stop waiting for shares no agent writes or awaits (ckptd.agent.orphans)
            self.agent.shares.started(self.root, str(msg["run"]))
            threading.Thread(target=self._drained,
                             args=(rid, str(msg["run"]), float(msg["timeout_s"])),
                             daemon=True).start()
        elif op == "held":  # a load: what memory holds, pinned until "unpin" (or we end)
            files, pinned = self.agent.holdings.pin_files(msg["storage"])
            self._next_lease += 1
            self._leases[self._next_lease] = pinned
            server = self.agent.peer_side.server
            address = server.address if server is not None else None
            self.reply({"id": rid, "op": "held", "files": files, "lease": self._next_lease,
                        "address": address})
        elif op == "unpin":
            for k in self._leases.pop(int(msg["lease"]), []):
                self.agent.holdings.pin(k, -1)
        elif op == "committed":  # a trainer saw its step commit (rank 0's agent commits)
            rank, step = int(msg["rank"]), int(msg["step"])
            kept, released = self.agent.holdings.commit_seen(msg["storage"], rank, step, self)
            if kept is not None:
                self.agent.peer_side.step_committed(msg["storage"], rank, kept)
            if released:  # before the reply: the trainer has them back when it returns
                self.reply({"op": "released", "segments": released})
            self.reply({"id": rid, "op": "committed"})
        elif op == "settle":  # the trainer closes: the retention owed, after its last job
            self._jobs.submit(self._settle_and_reply, rid)
        elif op == "status":
            self.reply({"id": rid, "op": "status", **self.agent.status()})
        elif op == "retire":  # a trainer of another ckptd: exit once idle
            self.agent.retire(str(msg.get("why", "another ckptd uses this node")))
            self.reply({"id": rid, "op": "retiring"})
        elif op == "stop":
            self.agent.stop()
            self.agent.session_ended(self)  # the agent waits for trainers, not for who asked
            self.reply({"id": rid, "op": "stopping"})
        else:
            raise ValueError(f"unknown request {op!r}")

    def _keep(self, job: SaveJob, seg: Segment, seg_id: int) -> HeldStep | None:
        """The memory tier's copy of this step: the arena itself (no copy). Only uncompressed
        files: there the arena range is the file."""
        if self.agent.keep_in_memory < 1 or job.codec != codecs.RAW or not job.round.plans:
            return None
        return HeldStep(job.share.step, seg, jobs.file_ranges(job), self, seg_id,
                    run=job.commit.run_id)

    def _drained(self, rid: Any, run: str, timeout_s: float) -> None:
        left = self.agent.wait_idle(timeout_s, but=run)
        self.reply({"id": rid, "op": "drained", "busy": left})

    def _run(self, rid: int, key: JobKey, msg: dict[str, Any], seg_id: int,
             outcome: Future[bool] | None) -> None:
        """Job ``rid``; ``outcome``: on rank 0, its commit's (:mod:`ckptd.agent.commits`)."""
        share = msg["job"].get("share", {})
        what = f"rank {share.get('rank')} step {share.get('step')}"
        claimed = 0
        try:
            seg = self.segments[seg_id]
            job = jobs.decode(msg["job"], seg.tensor)
            nbytes = job.round.nbytes
            # stopping, and too slow to write it with the rest: to a peer
            if not self.agent.book_write(nbytes):
                staged = seg.view()[:nbytes]
                to = self.agent.peer_side.hand_off(msg["storage"], msg["job"], staged,
                                                 job.share.rank, job.share.step)
                if to is not None:
                    self._handed(rid, nbytes, to)
                    return
                log.warning("ckptd agent: %s: no peer took it; writing it here, past the "
                            "grace window if it must", what)
                self.agent.book_write(nbytes, force=True)
            claimed = nbytes
            kept = self._keep(job, seg, seg_id)
            early = (self.agent.peer_side.replicate_staged(msg["storage"], job.share.rank, kept)
                     if kept is not None else None)
            step_key = job_step_key(msg)
            try:
                out = self._write(msg, job, seg, key, early)
                if outcome is not None:  # (a str: a peer's agent commits it)
                    outcome.set_result(not isinstance(out, str))
            except BaseException:
                if early is not None:
                    early.abandon()  # before the trainer gets this arena back
                raise
            if isinstance(out, str):  # the peer with its copy writes it
                self._handed(rid, nbytes, out)
                return
            if job.share.rank == 0:
                self._done(rid, msg, job, out, kept, True)
            else:
                self._done_after_commit(rid, msg, job, out, kept, step_key)
        except BaseException as e:  # noqa: BLE001 - the trainer learns it from the reply
            log.error("ckptd agent: %s failed: %s", what, e)
            self.reply(wire.failure(rid, e))
        finally:
            if outcome is not None and not outcome.done():
                outcome.set_result(False)  # it failed
            self.agent.unbook_write(claimed)
            self._job_done(seg_id)
            self.agent.job_ended(key)

    def _done(self, rid: int, msg: dict[str, Any], job: SaveJob, out: dict[str, Any],
              kept: HeldStep | None, committed: bool) -> None:
        """Reply to the written job ``rid``. ``committed``: rank 0's job committed it, here
        (the trainer then neither waits for the manifest nor says it saw it)."""
        out["committed"] = committed
        out["warning"] = self.agent.grace_check(
            msg["storage"], job.share.rank, out["nbytes"],
            0.0 if out.pop("resumed", False) else out["write_s"])
        out["kept"] = kept is not None
        if kept is not None:
            kept.committed = committed
            if kept.committed:
                self.agent.holdings.owned_by(msg["storage"], job.commit.run_id)
            out["released"] = self.agent.holdings.keep(msg["storage"], job.share.rank, kept)
            if kept.committed and not kept.dropped:  # (dropped: older than a commit since)
                self.agent.peer_side.step_committed(msg["storage"], job.share.rank, kept)
        else:
            out["released"] = []
        # one line a commit; a line a rank and save only when asked (DEBUG): at eight ranks a
        # node and a save a second, the log would take a line every 125 ms
        log.log(logging.INFO if job.share.rank == 0 else logging.DEBUG,
                "ckptd agent: rank %d step %d: %d bytes in %.3f s%s", job.share.rank,
                job.share.step, out["nbytes"], out["write_s"], ", committed" if committed else "")
        self.reply({"id": rid, "op": "done", **out})

    def _done_after_commit(self, rid: int, msg: dict[str, Any], job: SaveJob,
                           out: dict[str, Any], kept: HeldStep | None,
                           step_key: tuple[str, int, str]) -> None:
        """:meth:`_done` once rank 0's job of the same attempt here has ended, if one runs
        (:mod:`ckptd.agent.commits`), else at once, not committed. The reply is sent by the
        thread that ends rank 0's job, right after the commit, for every rank waiting: one
        thread replying to the node's ranks in turn, where each rank's own thread woke and
        waited for the GIL, and the last reply came later. This job's thread waits for it,
        then ends the job as before."""
        sent = threading.Event()
        failed: list[BaseException] = []

        def reply(committed: bool) -> None:
            try:
                self._done(rid, msg, job, out, kept, committed)
            except BaseException as e:  # noqa: BLE001 - raised in this job's thread
                failed.append(e)
            finally:
                sent.set()

        if not self.agent.commits.when_ended(step_key, reply):
            reply(False)
        sent.wait()
        if failed:
            raise failed[0]

    def _write(self, msg: dict[str, Any], job: SaveJob, seg: Segment, key: JobKey,
               early: Outgoing | None) -> dict[str, Any] | str:
        """Run the job here (:func:`ckptd.writer.job.run`: files, partial, on rank 0 the
        commit, the retention this session owes); or, if the stopping agent stopped it
        (:meth:`Agent._stop_writes_peers_hold`), have the peer that holds its staged copy write
        it: that node. Here after all if no such peer will."""
        assert self._io is not None, "hello first"
        io: Executor = Inline() if writes_inline(job) else self._io
        storage = self.agent.storage(msg["storage"])
        give_up = self.agent.give_up(msg["storage"], key)
        flight = Flight(job.round.nbytes, self.agent.gate(), early)
        # a stopping agent removes no old step: its grace window is for saves, and the next
        # run's writer removes them
        owed = None if self.agent.stopping.is_set() else self._retention
        try:
            with self.agent.writing(flight):
                out = run(job, storage, io, seg.tensor, signals=GroupStore(None), owed=owed,
                          give_up=give_up, gate=flight.gate, groups=self.agent.partial_groups)
            return {"nbytes": out.nbytes, "write_s": out.write_s}
        except Interrupted as e:
            assert early is not None  # only a save with a copy held by a peer is stopped
            written = e.written
        to = self.agent.peer_side.write_held(msg["storage"], msg["job"], early)
        if to is not None:
            return to
        log.warning("ckptd agent: rank %d step %d: no peer writes it from its copy; writing it "
                    "here (%d of its %d files left), past the grace window if it must",
                    job.share.rank, job.share.step, len(job.round.plans) - len(written),
                    len(job.round.plans))
        out = run(job, storage, io, seg.tensor, signals=GroupStore(None), owed=None,
                  give_up=give_up, gate=self.agent.gate(), written=written,
                  groups=self.agent.partial_groups)
        # its write time is of the files left: no bandwidth to learn
        return {"nbytes": out.nbytes, "write_s": out.write_s, "resumed": True}

    def _handed(self, rid: Any, nbytes: int, to: str) -> None:
        """The save ``rid`` is written (and on rank 0 committed) by node ``to``'s agent."""
        self.reply({"id": rid, "op": "done", "nbytes": nbytes, "write_s": 0.0,
                    "handed_to": to, "kept": False, "released": []})

    def _settle_retention(self) -> None:
        """Remove the old steps the last commit owes — unless the agent is stopping: its grace
        window is for saves, and the next run's writer removes them."""
        if not self.agent.stopping.is_set():
            self._retention.settle()

    def _settle_and_reply(self, rid: Any) -> None:
        try:
            self._settle_retention()
        finally:
            self.reply({"id": rid, "op": "settled"})

    def _job_done(self, seg_id: int) -> None:
        """A job on arena ``seg_id`` ended. If its trainer is gone, the step it kept is the
        agent's alone, and an arena it did not keep is removed (the session's end left both to
        the job: a step committed after its trainer died is still served from memory)."""
        with self._state:
            self._in_use[seg_id] -= 1
            if self._in_use[seg_id]:
                return
            del self._in_use[seg_id]
            ended = self._ended
        if ended:
            self.agent.holdings.orphan(self)
            seg = self.segments.get(seg_id)
            if seg is not None and not self.agent.holdings.is_kept(seg):
                self.agent.holdings.forget(seg)


__all__ = ["Session"]
