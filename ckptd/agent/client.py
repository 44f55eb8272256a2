"""The trainer's side of the node agent: staging memory from the agent, saves handed to it.

:class:`AgentClient` is the connection the agent's executor (:mod:`ckptd.agent.executor`) and
loads use. A reader thread receives the agent's replies and heartbeats; if the connection
closes, or nothing arrives for ``timeout_s``, the agent is *lost*: every pending request fails
with :class:`AgentLost` (the job in flight is then written from the same staged memory here),
and an agent that stopped answering is killed first, so that it cannot write a file the trainer
is writing too.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.agent import wire
from ckptd.agent.shm import Segment, map_readonly
from ckptd.errors import CkptdError

log = logging.getLogger("ckptd")

START_TIMEOUT_S = 60.0  # a cold start imports torch
# how long close() waits for the reader to see the end of the stream (it is woken at once,
# unless a callback of a reply it delivers still runs)
CLOSE_WAIT_S = 5.0


class AgentLost(CkptdError):
    """The node agent died or stopped answering; the save continues in this process."""


@dataclass(frozen=True)
class Held:
    """A node agent's memory as one load sees it."""

    files: dict[str, memoryview]  # data files of the root (path -> bytes, mapped read-only)
    lease: int  # keeps them unchanged until the load lets go
    copies: set[str]  # which of them are peer copies (another node's files)
    address: tuple[str, int] | None  # the agent's peer server (None: no job secret)


class AgentMismatch(CkptdError):
    """The node agent runs another ckptd (version or code) than this process."""


def _announce(node: str, hello: dict[str, Any]) -> None:
    """Said once, by the process that started the node's agent, where the user sees it."""
    budget = hello.get("budget")
    log.warning(
        "ckptd: started a node agent (pid %s) on node %s: it writes and commits this node's "
        "saves, so they outlive the training process, and keeps the newest step in shared "
        "memory for a restart (up to %s; given back %.0f s after the last trainer leaves; the "
        "process exits after %.0f idle s). Stop it: ckptd agent --stop. Without it: "
        "CKPTD_AGENT=0 or Checkpointer(agent=False). Its log: %s",
        hello.get("pid"), node, f"{budget / 2**30:.1f} GiB" if budget else "its budget",
        float(hello.get("release_s", 0)), float(hello.get("idle_exit_s", 0)), hello.get("log"))


class _Ticket:
    def __init__(self, reply: Future[dict[str, Any]]) -> None:
        self.reply = reply


class AgentClient:
    """A connection to this node's agent for one Checkpointer (one rank, one root)."""

    def __init__(self, sock: socket.socket, storage: dict[str, Any], timeout_s: float) -> None:
        self._sock = sock
        self._storage = storage
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._next = 0
        self._replies: dict[int, Future[dict[str, Any]]] = {}
        self._done: dict[int, Future[dict[str, Any]]] = {}
        self._unseen: list[Future[dict[str, Any]]] = []  # saw_commit's answers, not waited for
        self._segments: dict[int, tuple[int, Segment]] = {}  # data_ptr -> (id, mapping)
        self._lost: AgentLost | None = None
        self.keep = 0  # steps the agent keeps in memory: arenas it holds on to after a save
        self.peers = False  # it copies them to peers (and holds an arena while it does)
        self.on_release: Callable[[int], None] | None = None  # an arena is free again
        self._warned_pin = False
        uid, self.pid = wire.peer_uid_pid(sock)
        if uid != os.getuid():
            sock.close()
            raise wire.Refused(f"the agent socket belongs to uid {uid}, not {os.getuid()}")
        sock.settimeout(timeout_s)
        self._reader = threading.Thread(target=self._read, name="ckptd-agent-client",
                                        daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, storage: dict[str, Any], *, threads: int, start: bool = True,
                node: str | None = None, directory: str | None = None,
                timeout_s: float = 5.0, trainer: tuple[str, int] | None = None,
                paths: dict[str, str] | None = None) -> AgentClient:
        """This node's agent for this process's environment, started (detached, its own
        session) if none answers and ``start``. ``storage``: ``{"url", "options"}`` of the root
        the saves go to; ``trainer``: the run id and rank of the Checkpointer it serves (a peer
        may ask whether its saves can still come: :mod:`ckptd.agent.orphans`); ``paths``: the
        files of another agent to talk to (one of :func:`ckptd.agent.wire.node_agents`)."""
        node = node or wire.node_id()
        paths = paths or wire.paths(node, directory or wire.agent_dir())
        sock = _try_connect(paths["sock"])
        proc = None
        if sock is None and start:
            proc = _spawn(node, paths)
            deadline = time.monotonic() + START_TIMEOUT_S
            pause = 0.01
            while sock is None and time.monotonic() < deadline:
                # exit 0: a racing start, which leaves the node to the agent that won
                if proc.poll() not in (None, 0):
                    raise CkptdError(f"the ckptd agent it started exited at once (code "
                                     f"{proc.returncode}; its log: {paths['log']})")
                time.sleep(pause)
                pause = min(pause * 2, 0.2)
                sock = _try_connect(paths["sock"])
        if sock is None:
            raise CkptdError(f"no ckptd agent answers at {paths['sock']} (log: {paths['log']})")
        client = cls(sock, storage, timeout_s)
        try:
            hello = client._request({"op": "hello", "threads": threads, "storage": storage,
                                     **({"run": trainer[0], "rank": trainer[1]}
                                        if trainer else {})})
            if hello.get("op") == "refused":
                raise wire.Refused(str(hello.get("error")))
            theirs, ours = hello.get("identity"), wire.identity()
            if theirs != ours:
                client._retire(theirs, ours)
        except BaseException:
            client.close()
            raise
        client.keep = int(hello.get("keep", 0))
        client.peers = bool(hello.get("peers"))
        if proc is not None and proc.pid == client.pid:
            _announce(node, hello)
        return client

    def _retire(self, theirs: Any, ours: dict[str, str]) -> None:
        """The agent runs other code (another install, a patched copy): ask it to exit once its
        last trainer leaves, and raise :class:`AgentMismatch` (this process saves in process)."""
        def said(who: Any) -> str:
            return (f"ckptd {who.get('version')} (code {who.get('code')})"
                    if isinstance(who, dict) else "an unknown ckptd")

        why = f"a trainer of {said(ours)} (pid {os.getpid()}) found it running {said(theirs)}"
        try:
            self._request({"op": "retire", "why": why}, timeout_s=self._timeout_s)
        except CkptdError:  # an agent that predates "retire": it idles out, or --stop
            pass
        raise AgentMismatch(
            f"the node agent (pid {self.pid}) runs {said(theirs)}, this process "
            f"{said(ours)}: saving in process; that agent exits once its last trainer leaves "
            f"(or stop it now: ckptd agent --stop)")

    # ------------------------------------------------------------------ Offload
    @property
    def alive(self) -> bool:
        return self._lost is None

    @property
    def lost(self) -> AgentLost | None:
        """Why the agent is lost (None while it is not)."""
        return self._lost

    def allocate(self, nbytes: int) -> torch.Tensor:
        try:
            reply = self._request({"op": "arena", "nbytes": nbytes})
        except AgentLost:
            raise
        except CkptdError as e:  # over its memory budget: this process saves by itself
            self._lose(f"the node agent cannot hold a {nbytes}-byte arena: {e}")
            raise self._lost or AgentLost(str(e)) from e
        seg = Segment.attach(reply["path"], nbytes)
        # fault the pages into this process now (reserve() or the first save), not during
        # a later save's copy: one write a page (they are zero already)
        seg.tensor[::4096].zero_()
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            why = seg.register_with_cuda()  # GPU state is copied into it asynchronously
            if why is not None and not self._warned_pin:
                self._warned_pin = True
                log.warning("ckptd: %s; copies from the GPU into the node agent's memory are "
                            "synchronous", why)
        with self._lock:
            self._segments[seg.tensor.data_ptr()] = (int(reply["segment"]), seg)
        return seg.tensor

    def submit(self, arena: torch.Tensor, job: dict[str, Any]) -> _Ticket:
        with self._lock:
            found = self._segments.get(arena.data_ptr())
        if found is None:
            raise CkptdError("this arena is not the agent's memory")
        done: Future[dict[str, Any]] = Future()
        rid = self._new_id()
        with self._lock:
            self._done[rid] = done
        # no acknowledgement to wait for: once sendall returns the message is in the agent's
        # receive queue, which it reads even if this process dies right after
        self._send({"op": "save", "id": rid, "segment": found[0], "storage": self._storage,
                    "job": job})
        return _Ticket(done)

    def held(self) -> Held:
        """The data files of this root that the agent holds in memory (every rank of this node,
        its newest steps, peer copies), mapped read-only and pinned until :meth:`unpin`."""
        maps: dict[str, memoryview] = {}
        out: dict[str, memoryview] = {}
        copies: set[str] = set()
        reply = self._request({"op": "held", "storage": self._storage})
        for path, segment, start, end, origin in reply["files"]:
            try:
                mem = maps.get(segment) or maps.setdefault(segment, map_readonly(segment))
            except FileNotFoundError:  # replaced by a newer step meanwhile
                continue
            if 0 <= start <= end <= len(mem):
                out[path] = mem[start:end]
                if origin is not None:
                    copies.add(path)
        address = reply.get("address")
        return Held(out, int(reply["lease"]), copies,
                    (str(address[0]), int(address[1])) if address else None)

    def saw_commit(self, rank: int, step: int) -> None:
        """``rank``'s ``step`` committed (its trainer saw it): the agent may drop older steps
        and copy this one to its peers. Sent without waiting for the answer, so that the save
        completes at its commit, not one round trip to a busy agent later; :meth:`seen` waits
        for the answer (and the arenas it gives back, which arrive before it)."""
        reply = self._ask({"op": "committed", "storage": self._storage, "rank": rank,
                           "step": step})
        with self._lock:
            self._unseen.append(reply)

    def seen(self) -> None:
        """Wait for the answers to :meth:`saw_commit` not waited for yet: before the next
        staging (it may need an arena the commit let go of) and before closing."""
        with self._lock:
            waiting, self._unseen = self._unseen, []
        for reply in waiting:
            self._answer(reply, self._timeout_s)

    def settle(self) -> None:
        """The retention the agent owes this trainer's root (after its last save's commit),
        done before this returns — as a Saver's own close does it in process."""
        self._request({"op": "settle"})

    def unpin(self, lease: int) -> None:
        """The load is done: the steps it read may be given back or dropped."""
        if self._lost is None:
            self._send({"op": "unpin", "lease": lease})

    def drain(self, run: str, timeout_s: float) -> int:
        """Wait until the agent runs no job of another run than ``run`` (a previous
        incarnation's last saves, which must commit before this job takes the root over); the
        jobs still running after ``timeout_s``."""
        return int(self._request({"op": "drain", "run": run, "timeout_s": timeout_s},
                                 timeout_s=timeout_s + 5)["busy"])

    def stop_agent(self) -> None:
        """Ask the agent to finish its jobs and exit (tests, ``ckptd agent --stop``)."""
        self._request({"op": "stop"})

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the reader sees the end of the stream
        except OSError:
            pass
        # then the descriptor goes, once the reader has ended: closed under a reader about to
        # call recv, its number may be the next connection's by then, whose bytes that reader
        # would take (the next client then reads half a message)
        if self._reader is not threading.current_thread():
            self._reader.join(CLOSE_WAIT_S)
        self._sock.close()
        with self._lock:
            segments = [seg for _, seg in self._segments.values()]
        for seg in segments:
            seg.unregister_from_cuda()

    # ------------------------------------------------------------------ the wire
    def _new_id(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def _send(self, msg: dict[str, Any]) -> None:
        if self._lost is not None:
            raise self._lost
        try:
            with self._lock:
                wire.send(self._sock, msg)
        except OSError as e:
            self._lose(f"the node agent (pid {self.pid}) is gone: {e}")
            raise AgentLost(str(e)) from e

    def _request(self, msg: dict[str, Any], rid: int | None = None,
                 timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        return self._answer(self._ask(msg, rid), timeout_s)

    def _ask(self, msg: dict[str, Any], rid: int | None = None) -> Future[dict[str, Any]]:
        """Send a request; its answer comes through the returned future."""
        rid = rid if rid is not None else self._new_id()
        reply: Future[dict[str, Any]] = Future()
        with self._lock:
            self._replies[rid] = reply
        self._send({**msg, "id": rid})
        return reply

    def _answer(self, reply: Future[dict[str, Any]], timeout_s: float) -> dict[str, Any]:
        try:
            out = reply.result(timeout=timeout_s)
        except FutureTimeout:
            self._lose(f"the node agent (pid {self.pid}) did not answer a request")
            raise self._lost or AgentLost("agent lost") from None
        if out.get("op") == "failed":
            raise wire.error_of(out)
        return out

    def _read(self) -> None:
        while True:
            try:
                msg = wire.recv(self._sock)
            except TimeoutError:
                self._lose(f"the node agent (pid {self.pid}) sent nothing for "
                           f"{self._timeout_s:.0f} s", kill=True)
                return
            except (ConnectionError, OSError, ValueError) as e:
                self._lose(f"the node agent (pid {self.pid}) is gone: {e}")
                return
            rid = msg.get("id")
            if rid is None:
                if msg.get("op") == "released":  # an arena it held while copying to a peer
                    with self._lock:
                        by_id = {i: s for i, s in self._segments.values()}
                    for i in msg.get("segments", ()):
                        if i in by_id and self.on_release is not None:
                            self.on_release(by_id[i].tensor.data_ptr())
                continue  # else a heartbeat
            with self._lock:
                reply = self._replies.pop(rid, None)
                done = self._done.pop(rid, None) if msg.get("op") in ("done", "failed") else None
            if done is not None:
                if msg["op"] == "done":
                    with self._lock:
                        by_id = {i: s for i, s in self._segments.values()}
                    msg["released"] = [by_id[i].tensor.data_ptr()
                                       for i in msg.get("released", ()) if i in by_id]
                    done.set_result(msg)
                else:
                    done.set_exception(wire.error_of(msg))
            if reply is not None:
                reply.set_result(msg)

    def _lose(self, why: str, kill: bool = False) -> None:
        with self._lock:
            if self._lost is not None:
                return
            self._lost = AgentLost(why)
            pending = [*self._replies.values(), *self._done.values()]
            self._replies.clear()
            self._done.clear()
        if kill:  # it stopped answering: it must not write what this process now writes
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in pending:
            if not f.done():
                f.set_exception(self._lost)


_said_long: set[str] = set()  # socket paths reached through their directory, said once


def _try_connect(path: str) -> socket.socket | None:
    """A connection to the agent socket at ``path``; None if none answers there.
    :class:`~ckptd.agent.wire.SocketPathTooLong` if no address can reach it (before an agent
    is started that could not listen there either)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with wire.socket_address(path) as address:
            sock.connect(address)
    except OSError:
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    if path not in _said_long and wire.too_long_note(path):
        _said_long.add(path)
        log.info("ckptd: the node agent's socket %s%s", path, wire.too_long_note(path))
    return sock


def _spawn(node: str, paths: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start an agent in its own session (not in the trainer's process group, so it outlives
    the trainer and its launcher's worker group); a racing second start exits at once."""
    with open(paths["log"], "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd.agent", "--node", node,
             "--dir", os.path.dirname(paths["sock"])],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True)
    # reap it if it exits while this process lives (no zombie)
    threading.Thread(target=proc.wait, name="ckptd-agent-reaper", daemon=True).start()
    log.info("ckptd: started the node agent (pid %d) for node %s", proc.pid, node)
    return proc


__all__ = ["AgentClient", "AgentLost", "AgentMismatch", "Held", "START_TIMEOUT_S"]
