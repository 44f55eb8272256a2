"""A node agent's side of the job's other agents: the copies it sends (when a step is staged
or committed, ``CKPTD_PEER_COPY``), the copies, hand-offs and commit notices it receives, and the
hand-off of a save it cannot write inside its grace window. The wire is
:mod:`ckptd.agent.peer_wire`, the sending :mod:`ckptd.agent.replication`; ``docs/agent.md``, *Peer
copies*."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptd import config
from ckptd.agent import handoff, jobs
from ckptd.agent.core import AgentCore
from ckptd.agent.holdings import HeldStep, OverBudget
from ckptd.agent.orphans import JobKey
from ckptd.agent.peer_wire import NoAnswer, PeerServer, ask, job_secret
from ckptd.agent.replication import (
    NOTICE_TIMEOUT_S,
    Notice,
    Outgoing,
    Replicator,
    copy_when,
    said_nothing,
)
from ckptd.agent.shm import Segment
from ckptd.errors import CkptdError

if TYPE_CHECKING:
    import torch


log = logging.getLogger("ckptd.agent")


class PeerService:
    """Everything of one agent that talks to other agents; inert without ``CKPTD_JOB_SECRET``
    (no server, no replicator)."""

    def __init__(self, agent: AgentCore) -> None:
        self.agent = agent
        self.server: PeerServer | None = None
        self.replicator: Replicator | None = None
        self.copy_staged = False  # peer copies sent while being written (CKPTD_PEER_COPY)

    def start(self) -> None:
        """Listen for peers and start the replicator, if the job has a secret."""
        secret = job_secret()
        if secret is None:
            log.info("ckptd agent: no CKPTD_JOB_SECRET: no peer copies")
            return
        self.server = PeerServer(secret, config.AGENT_HOST.get(),
                                self._peer_accept, self._peer_lookup, self._take_over,
                                self.agent.shares.answer, self._peer_notice, self._write_held)
        self.copy_staged = copy_when() == "staged"
        rate = config.PEER_RATE.get() or None
        self.replicator = Replicator(self.agent.node, secret, self.server.address,
                                     config.PEER_COPIES.get(), rate,
                                     self.agent.stopping)
        log.info("ckptd agent: peer copies on, listening at %s:%d", *self.server.address)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def hand_off(self, spec: dict[str, Any], job: dict[str, Any], staged: memoryview,
                 rank: int, step: int) -> str | None:
        """Give a save to a peer that is not stopping (:meth:`Replicator.hand_off`), inside the
        grace left."""
        if self.replicator is None:
            return None
        return self.replicator.hand_off(self.agent.storage(spec), spec, job, staged, rank, step,
                                        self.agent.grace_left())

    def _room_for(self, header: dict[str, Any], total: int, what: str) -> Segment | None:
        """A segment for what a peer sends (a copy, a hand-off); None over the budget."""
        try:
            return self.agent.holdings.create(max(total, 1), self.agent.tag(what))
        except (OverBudget, OSError) as e:
            log.warning("ckptd agent: no room for node %s's rank %s step %s (%s): %s",
                        header.get("origin"), header.get("rank"), header.get("step"), what, e)
            return None

    def _peer_accept(self, header: dict[str, Any],
                     total: int) -> tuple[memoryview, Callable[[bool], None]] | None:
        seg = self._room_for(header, total, "peer")
        if seg is None:
            return None

        def finish(ok: bool) -> None:
            if ok:
                self._peer_stored(header, seg)
            else:
                self.agent.holdings.forget(seg)

        return seg.view()[:total], finish

    def _take_over(self, header: dict[str, Any],
                   total: int) -> tuple[memoryview, Callable[[bool], None]] | None:
        """A stopping peer's save, to write here: refused when this agent stops too."""
        if self.agent.stopping.is_set():
            return None
        job = JobKey.of(header["spec"], header["job"])  # a malformed header fails before memory
        seg = self._room_for(header, total, "handoff")
        if seg is None:
            return None
        self.agent.job_started(job)  # a restart on this node waits for it (``drain``)

        def finish(ok: bool) -> None:
            if not ok:
                self.agent.holdings.forget(seg)
                self.agent.job_ended(job)
                return
            self._write_handed(header, seg.tensor, job, lambda _: self.agent.holdings.forget(seg))

        return seg.view()[:total], finish

    def _write_held(self, header: dict[str, Any]) -> dict[str, Any]:
        """A stopping peer stopped writing a save between two blocks because it could not finish
        inside its grace window, and this agent holds the save's staged copy: write it from the
        copy (every file, the partial, on rank 0 the commit), as a hand-off. Refused when this
        agent stops too, holds no such copy, or the job's files are not the copy's."""
        what = f"node {header.get('origin')}'s rank {header.get('rank')} step {header.get('step')}"
        if self.agent.stopping.is_set():
            return {"ok": False, "error": "stopping too"}
        spec = header["spec"]
        kept = self.agent.holdings.held_copy(spec, str(header["origin"]), int(header["rank"]),
                                           int(header["step"]))
        if kept is None:
            return {"ok": False, "error": f"holds no copy of {what}"}
        try:
            job = jobs.decode(header["job"], kept.segment.tensor)  # every slot checked
            if jobs.file_ranges(job) != kept.files:
                raise CkptdError("its files are not those of the copy held")
            key = JobKey.of(spec, header["job"])
        except (CkptdError, KeyError, ValueError, TypeError) as e:
            self.agent.holdings.pin(kept, -1)
            log.warning("ckptd agent: refused to write %s from its copy: %s", what, e)
            return {"ok": False, "error": f"{what}: {e}"}
        self.agent.job_started(key)  # before the answer: the sender's job ends after it

        def done(ok: bool) -> None:
            if ok and job.share.rank == 0:  # this agent committed it
                self.agent.holdings.peer_committed(spec, str(header["origin"]), 0, job.share.step)
            self.agent.holdings.pin(kept, -1)

        self._write_handed(header, kept.segment.tensor, key, done)
        return {"ok": True}

    def _write_handed(self, header: dict[str, Any], staged: torch.Tensor, job: JobKey,
                      done: Callable[[bool], None]) -> None:
        """Write a save another node's agent handed over, on a thread of its own; then
        ``done(written)``."""

        def write() -> None:
            ok = False
            try:
                handoff.write(self.agent.storage(header["spec"]), header, staged,
                              self.agent.node, self.agent.give_up(header["spec"], job),
                              self.agent.gate())
                ok = True
            except BaseException as e:  # noqa: BLE001 - recorded for the other ranks by the writer
                log.error("ckptd agent: node %s's rank %s step %s failed here: %s",
                          header.get("origin"), header.get("rank"), header.get("step"), e)
            finally:
                done(ok)
                self.agent.job_ended(job)

        threading.Thread(target=write, name="ckptd-handoff", daemon=True).start()

    def write_held(self, spec: dict[str, Any], job: dict[str, Any], copy: Outgoing) -> str | None:
        """Ask a peer that holds ``copy`` (a staged copy of a save whose write this stopping
        agent stopped) to write the save from it: only the job travels. The node that writes
        it now, or None (none would: write it here)."""
        if self.replicator is None:
            return None
        message = {"op": "write", "spec": spec, "origin": self.agent.node, "rank": copy.rank,
                   "step": copy.step, "job": job}
        for peer in copy.holders:
            left = self.agent.grace_left()
            if left <= 0:
                break
            try:
                if ask(self.replicator.secret, peer, message, min(NOTICE_TIMEOUT_S, left)):
                    log.warning("ckptd agent: rank %d step %d is written by node %s from the "
                                "copy it holds", copy.rank, copy.step, peer["node"])
                    return str(peer["node"])
                log.warning("ckptd agent: node %s, which holds rank %d step %d, is lost",
                            peer["node"], copy.rank, copy.step)
            except NoAnswer as e:
                said_nothing(copy.rank, copy.step, e)
                return str(peer["node"])
            except (OSError, ValueError) as e:
                log.warning("ckptd agent: node %s does not write rank %d step %d from its "
                            "copy: %s", peer.get("node"), copy.rank, copy.step, e)
        return None

    def _peer_lookup(self, spec: dict[str, Any],
                     path: str) -> tuple[memoryview, Callable[[], None]] | None:
        found = self.agent.holdings.lookup(spec, path)
        if found is None:
            return None
        kept, mem = found
        return mem, lambda: self.agent.holdings.pin(kept, -1)

    def _peer_stored(self, header: dict[str, Any], seg: Segment) -> None:
        files, at = {}, 0
        for path, n in header["files"].items():
            files[str(path)] = (at, at + int(n))
            at += int(n)
        committed = bool(header.get("committed", True))
        kept = HeldStep(int(header["step"]), seg, files, None, -1, origin=str(header["origin"]),
                    committed=committed, run=str(header.get("run", "")))
        released = self.agent.holdings.keep(header["spec"], int(header["rank"]), kept)
        assert not released
        log.info("ckptd agent: %s node %s's rank %s step %s (%d bytes%s)",
                 "dropped (older than a step committed since)" if kept.dropped else "holds",
                 header["origin"], header["rank"], header["step"], at,
                 "" if committed else ", not committed yet")

    def _peer_notice(self, header: dict[str, Any]) -> dict[str, Any]:
        if self.agent.holdings.peer_committed(header["spec"], str(header["origin"]),
                                            int(header["rank"]), int(header["step"])):
            return {"ok": True}
        return {"ok": False, "error": f"holds no copy of rank {header['rank']} step "
                                      f"{header['step']} (any more)"}

    def replicate_staged(self, spec: dict[str, Any], rank: int, kept: HeldStep) -> Outgoing | None:
        """With ``CKPTD_PEER_COPY=staged``: send a step to the peers as soon as it is staged,
        while it is being written (the copy, None if not sent this way). The arena stays
        pinned until the copy is sent; if the save fails, :meth:`Outgoing.abandon` before the
        trainer gets its arena back."""
        if not self.copy_staged:
            return None
        return self._send_copy(spec, rank, kept, committed=False)

    def step_committed(self, spec: dict[str, Any], rank: int, kept: HeldStep) -> None:
        """``rank``'s kept step committed: send it to the peers now, or, if it was sent while
        being written, tell them it committed."""
        if kept.copy is None:
            self._send_copy(spec, rank, kept, committed=True)
        elif not kept.copy.committed and self.replicator is not None:
            self.replicator.submit(Notice(kept.copy))

    def _send_copy(self, spec: dict[str, Any], rank: int, kept: HeldStep,
                   committed: bool) -> Outgoing | None:
        rep = self.replicator
        if rep is None:
            return None
        storage = self.agent.storage(spec)
        rep.register(storage)
        mem = kept.segment.view()
        self.agent.holdings.pin(kept, +1)
        out = Outgoing(spec, storage, rank, kept.step,
                       {p: mem[a:b] for p, (a, b) in kept.files.items()},
                       lambda: self.agent.holdings.pin(kept, -1), committed=committed,
                       run=kept.run)
        kept.copy = out
        rep.submit(out)
        return out


__all__ = ["PeerService"]
