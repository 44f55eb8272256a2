"""The node agent: one process per node that writes, and commits, the saves its trainers staged
into its shared memory — so a save outlives the process that made it.

    python -m ckptd.agent [--node ID] [--dir DIR] [--idle-exit S]      (or: ckptd agent)

One agent per (user, node): the running agent holds ``agent-<node>.lock``; a second one exits at
once. Each client connection is a session with its own segments and its own job thread (saves
of one rank commit in order); a session's jobs run to the end when its trainer dies. Clients of
another user are refused by the kernel's peer credentials, whatever the socket's mode.

SIGTERM or a ``stop`` request: stop accepting, finish every job, exit. With no client and no job
for ``--idle-exit`` seconds the agent exits by itself (a job's agent does not outlive it for
long).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd import config
from ckptd.agent import wire
from ckptd.agent.memory import Kept, Memory, OverBudget
from ckptd.agent.peers import Outgoing, PeerServer, Replicator, job_secret
from ckptd.agent.shm import Segment, stale_segments, unlink
from ckptd.manifest import codecs, layout
from ckptd.storage import Storage, open_storage
from ckptd.writer import remote

log = logging.getLogger("ckptd.agent")


class Agent:
    def __init__(self, node: str, directory: str, idle_exit_s: float = 600.0,
                 keep_in_memory: int = 1, budget: int | None = None) -> None:
        self.node, self.dir, self.idle_exit_s = node, directory, idle_exit_s
        self.keep_in_memory = keep_in_memory
        self.memory = Memory(keep_in_memory, budget, self._give_back)
        self.peers: PeerServer | None = None
        self.replicator: Replicator | None = None
        self.paths = wire.paths(node, directory)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._sessions: set[Session] = set()
        self._busy = 0  # jobs accepted and not finished, over all sessions
        self._runs: dict[str, int] = {}  # the same, by run id
        self._idle_since = time.monotonic()
        self._storages: dict[str, Storage] = {}
        self._state: dict[tuple[str, int], int] = {}  # (root, rank) -> its last save's bytes
        self._write_bps = 0.0  # measured: the newest job's files over their write time
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    def run(self, lock_fd: int | None = None) -> int:
        """Serve until stopped. ``lock_fd``: the node's lock, if the caller took it."""
        lock_fd = lock_fd if lock_fd is not None else wire.take_lock(self.paths["lock"])
        if lock_fd is None:
            log.info("ckptd agent: another agent serves node %s", self.node)
            return 0
        for path in stale_segments(self.node):  # a killed agent's; we hold the node's lock
            unlink(path)
        self._start_peers()
        unlink(self.paths["sock"])  # a dead agent's; we hold the lock
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(self.paths["sock"])
        finally:
            os.umask(old)
        listener.listen(64)
        listener.settimeout(0.2)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        log.info("ckptd agent %d serving node %s at %s", os.getpid(), self.node,
                 self.paths["sock"])
        try:
            while not self.stopping.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    self._maybe_idle_exit()
                    continue
                self._open_session(conn)
        finally:
            listener.close()
            unlink(self.paths["sock"])
            self._drain()
            if self.peers is not None:
                self.peers.close()
            self.memory.close()
            os.close(lock_fd)
        log.info("ckptd agent %d stopped", os.getpid())
        return 0

    def _start_peers(self) -> None:
        secret = job_secret()
        if secret is None:
            log.info("ckptd agent: no CKPTD_JOB_SECRET: no peer copies")
            return
        self.peers = PeerServer(secret, os.environ.get("CKPTD_AGENT_HOST", "127.0.0.1"),
                                self._peer_accept)
        rate = float(os.environ.get("CKPTD_PEER_RATE", "0")) or None
        self.replicator = Replicator(self.node, secret, self.peers.address,
                                     int(os.environ.get("CKPTD_PEER_COPIES", "1")), rate)
        log.info("ckptd agent: peer copies on, listening at %s:%d", *self.peers.address)

    def _peer_accept(self, header: dict[str, Any],
                     total: int) -> tuple[memoryview, Callable[[bool], None]] | None:
        try:
            seg = self.memory.create(max(total, 1), f"{self.node}+peer")
        except (OverBudget, OSError) as e:
            log.warning("ckptd agent: no room for node %s's copy of rank %s step %s: %s",
                        header.get("origin"), header.get("rank"), header.get("step"), e)
            return None

        def finish(ok: bool) -> None:
            if ok:
                self._peer_stored(header, seg)
            else:
                self.memory.forget(seg)

        return seg.view()[:total], finish

    def _peer_stored(self, header: dict[str, Any], seg: Segment) -> None:
        files, at = {}, 0
        for path, n in header["files"].items():
            files[str(path)] = (at, at + int(n))
            at += int(n)
        released = self.memory.keep(header["spec"], int(header["rank"]),
                                    Kept(int(header["step"]), seg, files, None, -1))
        assert not released
        log.info("ckptd agent: holds node %s's rank %s step %s (%d bytes)", header["origin"],
                 header["rank"], header["step"], at)

    def grace_check(self, spec: dict[str, Any], rank: int, nbytes: int,
                    write_s: float) -> str | None:
        """Whether this node's state under ``spec`` can be written inside the SIGTERM grace
        window at the bandwidth just measured; the warning, once per root, if not."""
        root = json.dumps(spec, sort_keys=True)
        with self._lock:
            self._state[(root, rank)] = nbytes
            if write_s > 0:
                self._write_bps = nbytes / write_s
            node = sum(n for (r, _), n in self._state.items() if r == root)
            bps = self._write_bps
        grace = float(os.environ.get("CKPTD_GRACE_S", "30"))
        need = node / bps if bps else 0.0
        if need <= grace or root in self._warned:
            return None
        self._warned.add(root)
        advice = ("the peer copies keep it safe if this node is lost" if self.replicator else
                  "set CKPTD_JOB_SECRET to keep a peer copy")
        msg = (f"{node / 1e9:.1f} GB per node at {bps / 1e9:.2f} GB/s needs {need:.0f} s > "
               f"{grace:.0f} s of SIGTERM grace: {advice}")
        log.warning("ckptd agent: %s", msg)
        return msg

    def _give_back(self, owner: Any, seg_id: int) -> None:
        owner.reply({"op": "released", "segments": [seg_id]})

    def _maybe_idle_exit(self) -> None:
        with self._lock:
            idle = not self._sessions and not self._busy
            if not idle:
                self._idle_since = time.monotonic()
            elif time.monotonic() - self._idle_since >= self.idle_exit_s:
                log.info("ckptd agent: idle for %.0f s, exiting", self.idle_exit_s)
                self.stopping.set()

    def _drain(self) -> None:
        """Every accepted job finishes before the agent exits."""
        while self.wait_idle(60.0):
            log.info("ckptd agent: waiting for %d job(s) before exiting", self._busy)

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
        threading.Thread(target=session.serve, name=f"ckptd-agent-{pid}", daemon=True).start()

    # ------------------------------------------------------------------ shared by sessions
    def storage(self, spec: dict[str, Any]) -> Storage:
        key = json.dumps(spec, sort_keys=True)
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

    def job_started(self, run: str) -> None:
        with self._lock:
            self._busy += 1
            self._runs[run] = self._runs.get(run, 0) + 1

    def job_ended(self, run: str) -> None:
        with self._lock:
            self._busy -= 1
            self._runs[run] -= 1
            self._idle_since = time.monotonic()
            self._idle.notify_all()

    def session_ended(self, session: Session) -> None:
        with self._lock:
            self._sessions.discard(session)
            self._idle_since = time.monotonic()


class Session:
    """One client (a Checkpointer of one rank): its segments, its jobs in order."""

    def __init__(self, agent: Agent, conn: socket.socket, pid: int) -> None:
        self.agent, self.conn, self.pid = agent, conn, pid
        self.segments: dict[int, Segment] = {}
        self._send_lock = threading.Lock()
        self._open = True
        self._jobs = ThreadPoolExecutor(1, thread_name_prefix=f"ckptd-job-{pid}")
        self._io: ThreadPoolExecutor | None = None
        self._next_segment = 0
        self._leases: dict[int, list[Kept]] = {}  # loads reading kept steps
        self._next_lease = 0

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
                    self.reply({"id": msg.get("id"), "op": "failed", "error": str(e),
                                "kind": type(e).__name__})
        finally:
            with self._send_lock:
                self._open = False
            self.conn.close()
            for pinned in self._leases.values():
                for k in pinned:
                    self.agent.memory.pin(k, -1)
            self.agent.memory.orphan(self)
            for seg in self.segments.values():  # names go; a job still using one maps it
                if not self.agent.memory.is_kept(seg):
                    self.agent.memory.forget(seg)
            self._jobs.shutdown(wait=False)  # queued jobs still run; then the session is gone
            self.agent.session_ended(self)

    def _heartbeat(self) -> None:
        while self._open and not self.agent.stopping.is_set():
            self.reply({"op": "alive"})
            time.sleep(wire.HEARTBEAT_S)

    def _handle(self, msg: dict[str, Any]) -> None:
        op, rid = msg.get("op"), msg.get("id")
        if op == "hello":
            spec = msg.get("storage") or {}
            if self.agent.replicator is not None and spec.get("url"):
                # announced before the first save, so that every node's first copy finds its
                # peers
                self.agent.replicator.register(self.agent.storage(spec))
            threads = max(1, int(msg.get("threads", config.io_threads())))
            if self._io is None:
                self._io = ThreadPoolExecutor(threads, thread_name_prefix=f"ckptd-aio-{self.pid}")
            self.reply({"id": rid, "op": "hello", "pid": os.getpid(), "node": self.agent.node,
                        "version": remote.VERSION, "keep": self.agent.keep_in_memory,
                        "peers": self.agent.replicator is not None})
        elif op == "arena":
            nbytes = int(msg["nbytes"])
            self._next_segment += 1
            seg = self.agent.memory.create(nbytes, f"{self.agent.node}+{self.pid}")
            self.segments[self._next_segment] = seg
            self.reply({"id": rid, "op": "arena", "segment": self._next_segment,
                        "path": seg.path})
        elif op == "free":
            freed = self.segments.pop(int(msg["segment"]), None)  # a job using it holds it
            if freed is not None and not self.agent.memory.is_kept(freed):
                self.agent.memory.forget(freed)
        elif op == "save":
            # the trainer does not wait for an answer: a job that does not decode fails
            # through its "failed" reply
            seg = self.segments[int(msg["segment"])]
            run = str(msg["job"]["commit"]["run_id"])
            self.agent.job_started(run)
            self._jobs.submit(self._run, int(msg["id"]), run, msg, int(msg["segment"]))
        elif op == "drain":  # a restarted job waits for its predecessor's saves to finish
            threading.Thread(target=self._drained,
                             args=(rid, str(msg["run"]), float(msg["timeout_s"])),
                             daemon=True).start()
        elif op == "kept":  # a load: what memory holds, pinned until "unpin" (or we end)
            files, pinned = self.agent.memory.pin_files(msg["storage"])
            self._next_lease += 1
            self._leases[self._next_lease] = pinned
            self.reply({"id": rid, "op": "kept", "files": files, "lease": self._next_lease})
        elif op == "unpin":
            for k in self._leases.pop(int(msg["lease"]), []):
                self.agent.memory.pin(k, -1)
        elif op == "stop":
            self.agent.stopping.set()
            self.reply({"id": rid, "op": "stopping"})
        else:
            raise ValueError(f"unknown request {op!r}")

    def _keep(self, spec: dict[str, Any], storage: Storage, job: remote.Job, seg: Segment,
              seg_id: int) -> Kept | None:
        """The memory tier's copy of this step: the arena itself (no copy), and its peer
        copies. Only uncompressed files: there the arena range is the file."""
        if self.agent.keep_in_memory < 1 or job.codec != codecs.RAW or not job.round.plans:
            return None
        share = job.share
        step_dir = layout.step_dir(share.step)
        files = {f"{step_dir}/{layout.data_file(share.attempt, share.rank, p.index)}":
                 (p.start, p.end) for p in job.round.plans}
        kept = Kept(share.step, seg, files, self, seg_id)
        rep = self.agent.replicator
        if rep is not None:
            rep.register(storage)
            mem = seg.view()
            self.agent.memory.pin(kept, +1)
            rep.submit(Outgoing(spec, storage, share.rank, share.step,
                                {p: mem[a:b] for p, (a, b) in files.items()},
                                lambda: self.agent.memory.pin(kept, -1)))
        return kept

    def _drained(self, rid: Any, run: str, timeout_s: float) -> None:
        left = self.agent.wait_idle(timeout_s, but=run)
        self.reply({"id": rid, "op": "drained", "busy": left})

    def _run(self, rid: int, run: str, msg: dict[str, Any], seg_id: int) -> None:
        share = msg["job"].get("share", {})
        what = f"rank {share.get('rank')} step {share.get('step')}"
        try:
            assert self._io is not None, "hello first"
            seg = self.segments[seg_id]
            job = remote.decode(msg["job"], seg.tensor)
            storage = self.agent.storage(msg["storage"])
            out = remote.run(storage, self._io, job, seg.tensor)
            out["warning"] = self.agent.grace_check(msg["storage"], job.share.rank,
                                                    out["nbytes"], out["write_s"])
            kept = self._keep(msg["storage"], storage, job, seg, seg_id)
            out["kept"] = kept is not None
            out["released"] = (self.agent.memory.keep(msg["storage"], job.share.rank, kept)
                               if kept is not None else [])
            log.info("ckptd agent: %s: %d bytes in %.3f s%s", what, out["nbytes"],
                     out["write_s"], ", committed" if job.share.rank == 0 else "")
            self.reply({"id": rid, "op": "done", **out})
            remote.apply_retention(storage, job)
        except BaseException as e:  # noqa: BLE001 - the trainer learns it from the reply
            log.error("ckptd agent: %s failed: %s", what, e)
            self.reply({"id": rid, "op": "failed", "error": str(e), "kind": type(e).__name__})
        finally:
            self.agent.job_ended(run)


def main(node: str, directory: str, idle_exit_s: float, keep_in_memory: int = 1,
         budget: int | None = None, lock_fd: int | None = None) -> int:
    return Agent(node, directory, idle_exit_s, keep_in_memory, budget).run(lock_fd)


__all__ = ["Agent", "main"]
