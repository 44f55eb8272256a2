"""The node agent: one process per node that writes, and commits, the saves its trainers staged
into its shared memory — so a save outlives the process that made it.

    python -m ckptd.agent [--node ID] [--dir DIR] [--idle-exit S]      (or: ckptd agent)

One agent per (user, node): the running agent holds ``agent-<node>.lock``; a second one exits at
once. Each client connection is a session (:mod:`ckptd.agent.session`) with its own segments and
its own job thread (saves of one rank commit in order); a session's jobs run to the end when its
trainer dies. Clients of another user are refused by the kernel's peer credentials, whatever the
socket's mode.

SIGTERM or a ``stop`` request: stop accepting new clients; serve the connected trainers until
they close (their last save comes after the SIGTERM) or the grace window ends; finish every job —
a save that cannot be written in the grace left is handed to a peer that is not stopping
(:meth:`Agent.book_write`, :meth:`PeerService.hand_off`), and saves being written that cannot
finish in it are stopped and written by the peer that holds their staged copy
(:meth:`Agent._stop_writes_peers_hold`); wait for the newest step's peer copies inside the grace
left; exit. With no client and no job for ``--idle-exit`` seconds the agent exits by
itself (a job's agent does not outlive it for long).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from ckptd import catalog, config
from ckptd.agent import orphans, wire
from ckptd.agent.commits import Commits
from ckptd.agent.core import Flight
from ckptd.agent.gate import Gate
from ckptd.agent.holdings import Holdings
from ckptd.agent.orphans import JobKey
from ckptd.agent.peer_service import PeerService
from ckptd.agent.session import Session
from ckptd.agent.shm import remove_stale, unlink
from ckptd.agent.upkeep import Upkeep, release_after_s
from ckptd.errors import CkptdError
from ckptd.storage import Storage, open_storage
from ckptd.writer import exiting, own_partials
from ckptd.writer.partial_groups import Groups

log = logging.getLogger("ckptd.agent")


def grace_s() -> float:
    """``$CKPTD_GRACE_S`` (default 30): the SIGTERM grace window."""
    return config.GRACE_S.get()


class Agent:
    def __init__(self, node: str, directory: str, idle_exit_s: float = 600.0,
                 keep_in_memory: int = 1, budget: int | None = None,
                 release_s: float | None = None) -> None:
        self.node, self.dir, self.idle_exit_s = node, directory, idle_exit_s
        self.keep_in_memory = keep_in_memory
        self.holdings = Holdings(keep_in_memory, budget, self._give_back, self._owner_of)
        self.upkeep = Upkeep(self.holdings, idle_exit_s,
                             release_s if release_s is not None else release_after_s())
        self.peer_side = PeerService(self)  # the job's other agents (with CKPTD_JOB_SECRET)
        self.paths = wire.paths(node, directory)
        self.instance = wire.instance(node)  # the node and its environment's digest
        self.start_id = secrets.token_hex(4)
        self.stopping = threading.Event()
        self.deadline: float | None = None  # monotonic end of the grace window, once stopping
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._sessions: set[Session] = set()
        self._busy = 0  # jobs accepted and not finished, over all sessions
        self._writing = 0  # bytes of the saves being written here (claim / release)
        self._runs: dict[str, int] = {}  # the same, by run id
        self._root_jobs: Counter[str] = Counter()  # and by root
        self.shares = orphans.Shares()  # by attempt and rank, for peers' questions
        self.partial_groups = Groups()  # the node's ranks' partials share frame tables
        self.commits = Commits()  # what its rank-0 jobs committed, for the node's other ranks
        self._storages: dict[str, Storage] = {}
        self._state: dict[tuple[str, int], int] = {}  # (root, rank) -> its last save's bytes
        self._write_bps = 0.0  # measured: the newest job's files over their write time
        # or, instead, what the launcher knows of its storage's bandwidth (a write to the page
        # cache measures the cache, not the disk; the first save has nothing measured)
        self._assumed_bps = config.AGENT_WRITE_BPS.get()
        # at most this many bytes/s, each save (the storage's bandwidth kept for training's own
        # traffic: its data loading, say); 0: no limit
        self.write_rate = config.AGENT_WRITE_RATE.get()
        self._flights: set[Flight] = set()  # the saves being written here, for a stop
        self._warned: set[str] = set()  # warnings given once: a root (grace), an owner error
        self._said = wire.RateLog(log)  # warnings a flood could repeat

    # ------------------------------------------------------------------ lifecycle
    def run(self, lock_fd: int | None = None) -> int:
        """Serve until stopped. ``lock_fd``: the node's lock, if the caller took it."""
        lock_fd = lock_fd if lock_fd is not None else wire.take_lock(self.paths["lock"])
        if lock_fd is None:
            log.info("ckptd agent: another agent serves node %s", self.node)
            return 0
        self._remove_stale_segments()
        self.peer_side.start()
        unlink(self.paths["sock"])  # a dead agent's; we hold the lock
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            with wire.socket_address(self.paths["sock"]) as address:
                listener.bind(address)
        finally:
            os.umask(old)
        listener.listen(64)
        listener.settimeout(0.2)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        log.info("ckptd agent %d (ckptd %s, code %s) serving node %s at %s%s (budget %s bytes; "
                 "leaves %d bytes of the node's memory and %d of /dev/shm free; gives a root's "
                 "steps back %.0f s after its last trainer, exits after %.0f idle s)",
                 os.getpid(), wire.identity()["version"], wire.identity()["code"], self.node,
                 self.paths["sock"], wire.too_long_note(self.paths["sock"]),
                 self.holdings.budget, self.holdings.reserve, self.holdings.shm_reserve,
                 self.upkeep.release_s, self.idle_exit_s)
        pause = 0.0
        try:
            while not self.stopping.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    self._upkeep()
                    continue
                except OSError as e:  # out of file descriptors, say: the trainer saves in
                    # process meanwhile, and the agent stays for those it serves
                    pause = min(max(2 * pause, 0.05), 2.0)
                    self._said.warning("accept", "ckptd agent: could not accept a trainer (%s); "
                                       "trying again in %.2f s", e, pause)
                    self.stopping.wait(pause)
                    continue
                pause = 0.0
                try:
                    self._open_session(conn)
                except OSError as e:  # it left before it was served
                    conn.close()
                    self._said.warning("session", "ckptd agent: a trainer's connection "
                                       "failed: %s", e)
                self._upkeep()  # (also when connections keep coming)
            log.info("ckptd agent: stopping; %.1f s of grace left", self.grace_left())
        finally:
            self.stop()  # the grace window bounds the drain even when serving failed
            listener.close()
            unlink(self.paths["sock"])
            self._drain()
            self.peer_side.close()
            self.holdings.close()
            os.close(lock_fd)
        log.info("ckptd agent %d stopped", os.getpid())
        return 0

    def _remove_stale_segments(self) -> None:
        """A killed agent's segments (this agent holds their node's lock: none is in use)."""
        skipped = remove_stale(self.instance)
        if skipped:
            log.warning("ckptd agent: %d file(s) in shared memory named like this agent's and "
                        "not removable, skipped (another user's? e.g. %s)", len(skipped),
                        skipped[0])

    def tag(self, what: str) -> str:
        """The name of a new segment of this agent (its node and environment, this start's
        random part, ``what``): a killed agent's are found by the next one, and no name of
        another agent's, or another user's, is ever the same."""
        return f"{self.instance}+{self.start_id}.{what}"

    def stop(self) -> None:
        """SIGTERM (async-signal-safe: no locks, no logging) or a ``stop`` request."""
        if self.deadline is None:
            self.deadline = time.monotonic() + grace_s()
        self.stopping.set()

    def grace_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    @property
    def _bandwidth(self) -> float:
        """Bytes/s this node writes: the launcher's figure if given, else the measured one;
        at most the rate limit."""
        bps = self._assumed_bps or self._write_bps
        return min(bps, self.write_rate) if bps and self.write_rate else bps or self.write_rate

    def gate(self) -> Gate:
        """What each file of one save here passes first: the rate limit, and the stop."""
        return Gate(self.write_rate or None)

    @contextlib.contextmanager
    def writing(self, flight: Flight) -> Iterator[Flight]:
        """``flight`` is being written here (a stop may hand it to the peer with its copy)."""
        with self._lock:
            self._flights.add(flight)
        try:
            yield flight
        finally:
            with self._lock:
                self._flights.discard(flight)

    def _stop_writes_peers_hold(self) -> None:
        """At SIGTERM: if the saves being written here cannot all be finished inside the grace
        window at this node's bandwidth, stop every one whose staged copy a peer holds
        (``CKPTD_PEER_COPY=staged``; a copy still being sent is waited for, inside the grace
        left) between two blocks: its job then asks that peer to write it from the copy
        (:meth:`PeerService.write_held`), and writes it here only if none will."""
        with self._lock:
            flights, bps = list(self._flights), self._bandwidth
        left = sum(f.left for f in flights)
        if not bps or left / bps <= self.grace_left():
            return
        log.warning("ckptd agent: %.3g GB still to write at %.3g GB/s need %.0f s > %.0f s of "
                    "grace left: the saves a peer holds a copy of go to that peer", left / 1e9,
                    bps / 1e9, left / bps, self.grace_left())
        for f in flights:
            if f.copy is None or not f.copy.finished.wait(max(0.0, self.grace_left())):
                continue
            if f.copy.holders and f.left:
                log.warning("ckptd agent: rank %d step %d: stopped with %d of %d bytes to "
                            "write", f.copy.rank, f.copy.step, f.left, f.nbytes)
                f.gate.stop()

    def book_write(self, nbytes: int, *, force: bool = False) -> bool:
        """Whether a save of ``nbytes`` can be written here before the grace window ends, with
        the bytes of every save this node is writing already (one disk: the node's jobs share
        its bandwidth). True while not stopping, and when no bandwidth is measured or assumed;
        then the bytes count as being written until :meth:`unbook_write`. ``force``: count them
        whatever the answer (a save that no peer took is written here all the same)."""
        with self._lock:
            bps = self._bandwidth
            fits = (not self.stopping.is_set() or not bps
                    or (self._writing + nbytes) / bps <= self.grace_left())
            if fits or force:
                self._writing += nbytes
            return fits

    def unbook_write(self, nbytes: int) -> None:
        with self._lock:
            self._writing -= nbytes

    def grace_check(self, spec: dict[str, Any], rank: int, nbytes: int,
                    write_s: float) -> str | None:
        """Whether this node's state under ``spec`` can be written inside the SIGTERM grace
        window at the bandwidth just measured; the warning, once per root, if not."""
        root = wire.root_key(spec)
        with self._lock:
            self._state[(root, rank)] = nbytes
            if write_s > 0:
                self._write_bps = nbytes / write_s
            node = sum(n for (r, _), n in self._state.items() if r == root)
            bps = self._bandwidth
        grace = grace_s()
        need = node / bps if bps else 0.0
        if need <= grace or root in self._warned:
            return None
        self._warned.add(root)
        advice = ("the peer copies keep it safe if this node is lost"
                  if self.peer_side.replicator else "set CKPTD_JOB_SECRET to keep a peer copy")
        msg = (f"{node / 1e9:.3g} GB per node at {bps / 1e9:.3g} GB/s needs {need:.0f} s > "
               f"{grace:.0f} s of SIGTERM grace: {advice}")
        log.warning("ckptd agent: %s", msg)
        return msg

    def _give_back(self, owner: Any, seg_id: int) -> None:
        owner.reply({"op": "released", "segments": [seg_id]})

    def _owner_of(self, spec: dict[str, Any]) -> str | None:
        """The run that owns the root now (``owner.json``); None if unknown."""
        try:
            owner = catalog.read_owner(self.storage(spec))
        except (CkptdError, OSError) as e:
            said = f"owner of {spec.get('url')}: {e}"  # once per root and reason, not per save
            if said not in self._warned:
                self._warned.add(said)
                log.warning("ckptd agent: who owns %s is unknown (%s): older steps stay in "
                            "memory", spec.get("url"), e)
            return None
        return owner.run if owner is not None else None

    def _in_use(self) -> tuple[set[str], int, int]:
        """The roots of the connected trainers and of the running saves; the saves running;
        the trainers connected."""
        with self._lock:
            roots = {s.root for s in self._sessions if s.root}
            roots |= {r for r, n in self._root_jobs.items() if n}
            return roots, self._busy, len(self._sessions)

    def _upkeep(self) -> None:
        roots, busy, sessions = self._in_use()
        if self.upkeep.tick(roots, bool(busy or sessions)):
            self.stop()

    def retire(self, why: str) -> None:
        """A trainer of another ckptd found this agent: serve the trainers it has, accept no
        new one, and exit once idle (never under a save)."""
        if self.upkeep.retiring is None:
            log.warning("ckptd agent: retiring: %s; exiting once its %d trainer(s) left",
                        why, self._in_use()[2])
            self.upkeep.retiring = why

    def status(self) -> dict[str, Any]:
        """What ``ckptd agent --status`` shows (of the trainers connected, not the asker)."""
        roots, busy, sessions = self._in_use()
        sessions -= 1
        return {"pid": os.getpid(), "node": self.node, **wire.identity(),
                "log": self.paths["log"], "memory_used": self.holdings.used,
                "memory_budget": self.holdings.budget, "memory_reserve": self.holdings.reserve,
                "shm_reserve": self.holdings.shm_reserve, "gc_frozen": gc.get_freeze_count(),
                **self.upkeep.status(roots, busy, sessions)}

    def _drain(self) -> None:
        """Before the agent exits: the connected trainers' last saves (they come after the
        SIGTERM) until the trainers close or the grace window ends; every accepted job; the
        newest steps' peer copies, inside the grace left. A job's wait for other ranks (a
        coordinator's for their partials, a rank's for the commit) ends with the grace window:
        the batch system's SIGKILL follows it, and a dead rank's partial never comes."""
        exiting.begin(self.grace_left(),
                      f"the node agent is stopping and its {grace_s():g}s grace window ended")
        self._stop_writes_peers_hold()
        with self._idle:
            while (self._sessions or self._busy) and self.grace_left() > 0:
                self._idle.wait(min(1.0, self.grace_left()))
        while self.wait_idle(60.0):
            log.info("ckptd agent: waiting for %d job(s) before exiting", self._busy)
        if self.peer_side.replicator is not None:
            left = self.peer_side.replicator.wait_sent(max(0.0, self.grace_left()))
            if left:
                log.warning("ckptd agent: exiting with %d peer copies not sent", left)

    def _open_session(self, conn: socket.socket) -> None:
        uid, pid = wire.peer_uid_pid(conn)
        if uid != os.getuid():
            log.warning("ckptd agent: refused a client of uid %d (pid %d)", uid, pid)
            try:
                wire.send(conn, {"op": "refused",
                                 "error": f"the agent of uid {os.getuid()} serves only its user"})
            finally:
                conn.close()
            return
        session = Session(self, conn, pid)
        with self._lock:
            self._sessions.add(session)
        try:
            threading.Thread(target=session.serve, name=f"ckptd-agent-{pid}",
                             daemon=True).start()
        except RuntimeError as e:  # no thread to be had: that trainer saves in process
            self.session_ended(session)
            conn.close()
            self._said.warning("thread", "ckptd agent: refused a trainer: %s", e)

    # ------------------------------------------------------------------ shared by sessions
    def storage(self, spec: dict[str, Any]) -> Storage:
        wire.check_root(spec.get("url"))
        key = wire.root_key(spec)
        with self._lock:
            if key not in self._storages:
                self._storages[key] = open_storage(spec["url"], spec.get("options") or None)
            return self._storages[key]

    def wait_idle(self, timeout_s: float, but: str | None = None) -> int:
        """Wait until no job runs (at most ``timeout_s``), not counting the jobs of run
        ``but``; the jobs still running."""
        deadline = time.monotonic() + timeout_s

        def busy() -> int:
            return self._busy - self._runs.get(but, 0) if but is not None else self._busy

        with self._idle:
            while busy() and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())
            return busy()

    def job_started(self, job: JobKey) -> None:
        self.shares.writing(job.attempt, job.rank, +1)
        with self._lock:
            self._busy += 1
            self._root_jobs[job.root] += 1
            self._runs[job.run] = self._runs.get(job.run, 0) + 1

    def job_ended(self, job: JobKey) -> None:
        self.shares.writing(job.attempt, job.rank, -1)
        if job.rank == 0:  # the coordinating job (give_up)
            self.shares.forget(job.attempt)
        with self._lock:
            self._busy -= 1
            self._runs[job.run] -= 1
            self._root_jobs[job.root] -= 1
            if not self._root_jobs[job.root]:
                del self._root_jobs[job.root]
            self._idle.notify_all()
        self._release_dirs_when_idle()
        self.upkeep.used({job.root}, True)

    def _release_dirs_when_idle(self) -> None:
        """No trainer connected and no job running: the directories the storages keep open
        for reads are closed (opened again when needed), so that an idle agent does not keep
        a filesystem of its trainers' busy (``umount``) for its idle minutes."""
        with self._lock:
            storages = [] if self._sessions or self._busy else list(self._storages.values())
        for st in storages:
            st.close()

    def give_up(self, spec: dict[str, Any], job: JobKey) -> Callable[[list[int]], str | None]:
        """When a coordinating job of ``job``'s run stops waiting for shares that cannot
        come: its run was restarted on this node and no agent writes or awaits them
        (:mod:`ckptd.agent.orphans`)."""
        return orphans.give_up(self.peer_side.replicator, self.storage(spec), self.shares, job)

    def session_ended(self, session: Session) -> None:
        with self._lock:
            self._sessions.discard(session)
            self._idle.notify_all()
        self._release_dirs_when_idle()
        self.upkeep.used({session.root} if session.root else set(), True)


def main(node: str, directory: str, idle_exit_s: float, keep_in_memory: int = 1,
         budget: int | None = None, lock_fd: int | None = None,
         release_s: float | None = None) -> int:
    own_partials.keep_every_rank()  # its coordinator takes the node's partials from memory
    agent = Agent(node, directory, idle_exit_s, keep_in_memory, budget, release_s)
    # What it holds from its start (torch's modules and their objects: ~10^5) is never garbage;
    # frozen, the cyclic collector's full passes skip it, which were ~6 % of its CPU on a node
    # of tiny saves (``perf``; benchmarks/commit.py --agent). Garbage made later is collected
    # as before.
    gc.collect()
    gc.freeze()
    return agent.run(lock_fd)


__all__ = ["Agent", "main"]
