"""Peer copies: each agent sends its node's newest steps to ``k`` other agents of the same job, so
that a node lost with its memory is read from a peer's memory, not from storage.

* **Who**: agents of one job share a secret (``$CKPTD_JOB_SECRET``, set by the launcher; there is
  no default, and without it there are no peer copies). A connection starts with a challenge: the
  receiver sends a random nonce, the sender answers ``HMAC-SHA256(secret, nonce)``; anything else
  is refused. The data are not trusted either way: the loader verifies every frame's checksum.
* **Where**: an agent that serves a root registers itself at ``_agents/<node>.json`` under that
  root (host, port), and sends to the ``k`` nodes after its own in the sorted list of registered
  nodes (a ring), ``$CKPTD_PEER_COPIES`` (default 1). Its address is ``$CKPTD_AGENT_HOST``
  (default 127.0.0.1: set it to the node's cluster address).
* **When**: after the step is written and the trainer told, on a thread of its own, at most
  ``$CKPTD_PEER_RATE`` bytes/s (default unlimited): replication never delays a commit or the
  trainer. A copy that does not fit the receiver's memory budget is skipped with a warning.
* **Hand-off**: a stopping agent (SIGTERM) whose node cannot write a save inside the grace left
  sends that save's job and staged bytes to the next agent of the ring that is not stopping,
  which writes it (files, partial, on rank 0 the commit) as if its own trainer had staged it
  (:meth:`Replicator.hand_off`, ``docs/agent.md``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptd.agent import wire
from ckptd.storage import Storage

log = logging.getLogger("ckptd.agent")

REGISTRY = "_agents"
RETRY_S = 60.0  # how long a copy waits for peers to announce themselves


def job_secret() -> bytes | None:
    s = os.environ.get("CKPTD_JOB_SECRET")
    return s.encode() if s else None


@dataclass
class Outgoing:
    """One rank's files of one step, to be sent to the peers."""

    spec: dict[str, Any]
    storage: Storage
    rank: int
    step: int
    files: dict[str, memoryview]  # path -> bytes (views of the kept arena)
    done: Callable[[], None]  # sent or given up: the arena may be used again


def _recv_into(sock: socket.socket, into: memoryview) -> None:
    got = 0
    while got < len(into):
        k = sock.recv_into(into[got:], len(into) - got)
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k


def answer_challenge(sock: socket.socket, secret: bytes, refused: str) -> None:
    """The connecting side of the challenge :meth:`PeerServer._handle` poses: the HMAC of its
    nonce; ``ConnectionError(refused)`` if the answer is not accepted."""
    nonce = bytes.fromhex(wire.recv(sock, 4096)["nonce"])
    wire.send(sock, {"mac": hmac.new(secret, nonce, hashlib.sha256).hexdigest()})
    if not wire.recv(sock, 4096).get("ok"):
        raise ConnectionError(refused)


Finish = Callable[[bool], None]


Lookup = Callable[[dict[str, Any], str], tuple[memoryview, Callable[[], None]] | None]


Accept = Callable[[dict[str, Any], int], tuple[memoryview, Finish] | None]


Answer = Callable[[dict[str, Any]], dict[str, Any]]


class PeerServer:
    """Receives peer copies and hand-offs and answers range reads, from agents and loaders of
    the same job.

    ``accept(header, nbytes)`` gives the memory to receive a copy into and what to call once it
    is received (True) or the transfer failed (False); None refuses it. ``take_over`` does the
    same for a hand-off (``header["op"] == "handoff"``: a stopping agent's save, to be written
    here). ``lookup(spec, path)`` gives a file held in memory and what to call when it has been
    read; None if not held. ``holds(question)`` answers which shares this agent writes or
    awaits (``question["op"] == "holds"``: :mod:`ckptd.agent.orphans`)."""

    def __init__(self, secret: bytes, host: str, accept: Accept,
                 lookup: Lookup | None = None, take_over: Accept | None = None,
                 holds: Answer | None = None) -> None:
        self.secret, self._accept, self._lookup = secret, accept, lookup
        self._take_over, self._holds = take_over, holds
        self.sock = socket.create_server((host, 0))
        self.address = self.sock.getsockname()[:2]
        threading.Thread(target=self._serve, name="ckptd-peers", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn, addr), daemon=True).start()

    def _handle(self, conn: socket.socket, addr: Any) -> None:
        finish: Finish | None = None
        with conn:
            try:
                conn.settimeout(60)
                nonce = secrets.token_bytes(32)
                wire.send(conn, {"nonce": nonce.hex()})
                answer = wire.recv(conn, 4096).get("mac", "")  # before auth: small
                expected = hmac.new(self.secret, nonce, hashlib.sha256).hexdigest()
                if not isinstance(answer, str) or not hmac.compare_digest(answer, expected):
                    log.warning("ckptd agent: refused a peer at %s: not of this job", addr)
                    wire.send(conn, {"ok": False, "error": "not of this job"})
                    return
                wire.send(conn, {"ok": True})
                header = wire.recv(conn, 64 << 20)
                if header.get("op") == "read":
                    self._reads(conn, header)
                    return
                if header.get("op") == "holds":
                    wire.send(conn, self._holds(header) if self._holds is not None else
                              {"ok": False, "error": "no answer to that here"})
                    return
                total = sum(int(n) for n in header["files"].values())
                if header.get("op") == "handoff":
                    accepted = self._take_over(header, total) if self._take_over else None
                else:
                    accepted = self._accept(header, total)
                wire.send(conn, {"ok": accepted is not None})
                if accepted is None:
                    return
                into, done = accepted
                finish = done  # until the bytes are in, a failure gives the memory back
                _recv_into(conn, into[:total])
                finish = None
                done(True)
                wire.send(conn, {"ok": True})
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("ckptd agent: a peer copy from %s failed: %s", addr, e)
                if finish is not None:
                    finish(False)  # its memory goes back to the budget

    def _reads(self, conn: socket.socket, header: dict[str, Any]) -> None:
        """Range reads of files held in memory, one after another on this connection until
        the reader closes it: ``{"op": "read", "spec", "path", "offset", "length"}`` ->
        ``{"ok": true}`` and the bytes, or ``{"ok": false, "error"}``."""
        conn.settimeout(600)  # a loader keeps its connection between reads
        while True:
            path, offset, length = str(header["path"]), int(header["offset"]), int(header["length"])
            found = self._lookup(header["spec"], path) if self._lookup is not None else None
            if found is None:
                wire.send(conn, {"ok": False, "error": f"{path}: not held in memory"})
            else:
                mem, release = found
                try:
                    if offset < 0 or length < 0 or offset + length > len(mem):
                        wire.send(conn, {"ok": False, "error": f"{path}: {length} bytes at "
                                         f"{offset} are outside its {len(mem)}"})
                    else:
                        wire.send(conn, {"ok": True})
                        conn.sendall(mem[offset: offset + length])
                finally:
                    release()
            try:
                header = wire.recv(conn, 1 << 20)
            except ConnectionError:
                return  # the reader is done

    def close(self) -> None:
        self.sock.close()


class PeerReads:
    """A loader's side of range reads from other agents' memory (``PeerServer._reads``): one
    authenticated connection per agent and thread at a time, kept for the next read."""

    def __init__(self, secret: bytes, spec: dict[str, Any], timeout_s: float = 30.0) -> None:
        self.secret, self.spec, self.timeout_s = secret, spec, timeout_s
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()

    def read_into(self, address: tuple[str, int], path: str, offset: int,
                  buf: memoryview) -> None:
        """``len(buf)`` bytes of ``path`` at ``offset`` from the agent at ``address``; raises
        OSError (ConnectionError, timeout) when it does not hold them or cannot be reached."""
        with self._lock:
            idle = self._idle.setdefault(address, [])
            sock = idle.pop() if idle else None
        if sock is None:
            sock = self._connect(address)
        try:
            wire.send(sock, {"op": "read", "spec": self.spec, "path": path, "offset": offset,
                             "length": len(buf)})
            reply = wire.recv(sock, 4096)
            if not reply.get("ok"):
                raise ConnectionError(f"agent at {address[0]}:{address[1]}: "
                                      f"{reply.get('error', 'refused')}")
            _recv_into(sock, buf)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._idle[address].append(sock)

    def _connect(self, address: tuple[str, int]) -> socket.socket:
        sock = socket.create_connection(address, timeout=min(self.timeout_s, 5.0))
        try:
            sock.settimeout(self.timeout_s)
            answer_challenge(sock, self.secret,
                              f"agent at {address[0]}:{address[1]} refused this job")
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        with self._lock:
            socks = [s for ss in self._idle.values() for s in ss]
            self._idle.clear()
        for s in socks:
            s.close()


class Replicator:
    """Sends each kept step to the next ``k`` registered nodes, one at a time, in the
    background; a newer step of the same rank replaces one still waiting."""

    def __init__(self, node: str, secret: bytes, address: tuple[str, int], k: int,
                 rate: float | None, stopping: threading.Event | None = None) -> None:
        self.node, self.secret, self.address, self.k, self.rate = node, secret, address, k, rate
        self.stopping = stopping or threading.Event()  # then no more waiting for new peers
        self._queue: queue.Queue[Outgoing] = queue.Queue()
        self._registered: set[str] = set()
        self.sent = 0  # bytes, for tests and the log
        self._pending = 0  # copies submitted and not yet sent or given up
        self._idle = threading.Condition()
        threading.Thread(target=self._run, name="ckptd-replicate", daemon=True).start()

    def register(self, storage: Storage) -> None:
        """Announce this agent under the root (once per root)."""
        if storage.url in self._registered:
            return
        doc = {"node": self.node, "host": self.address[0], "port": self.address[1],
               "pid": os.getpid(), "time": time.time()}
        storage.put_atomic(f"{REGISTRY}/{self.node}.json", json.dumps(doc).encode())
        self._registered.add(storage.url)

    def registered(self, storage: Storage) -> bool:
        """Whether this agent announced itself under the root (then :meth:`peers` is every
        other node of the job that did)."""
        return storage.url in self._registered

    def submit(self, item: Outgoing) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(item)

    def wait_sent(self, timeout_s: float) -> int:
        """Wait (at most ``timeout_s``) until every submitted copy is sent or given up; the
        copies still pending."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())
            return self._pending

    def peers(self, storage: Storage) -> list[dict[str, Any]]:
        nodes = []
        for name in sorted(storage.list_dir(REGISTRY)):
            try:
                doc = json.loads(storage.read_bytes(f"{REGISTRY}/{name}"))
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and isinstance(doc.get("node"), str):
                nodes.append(doc)
        names = [d["node"] for d in nodes]
        if self.node not in names:
            return []
        i = names.index(self.node)
        return nodes[i + 1:] + nodes[:i]  # the ring, from the next node on

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                copies = self._replicate(item)
                if copies < self.k:
                    log.warning("ckptd agent: rank %d step %d has %d of %d peer copies",
                                item.rank, item.step, copies, self.k)
            except Exception as e:  # noqa: BLE001 - a copy is a bonus: the step is durable
                log.warning("ckptd agent: peer copy of rank %d step %d failed: %s", item.rank,
                            item.step, e)
            finally:
                item.done()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _replicate(self, item: Outgoing) -> int:
        """Send ``item`` to the next ``k`` nodes of the ring that take it. Nodes that announce
        themselves later (a job's agents start one by one) are waited for, with a growing
        pause, for up to ``RETRY_S`` — or until a newer step is queued or the agent stops."""
        copies, tried = 0, set()
        deadline, pause = time.monotonic() + RETRY_S, 0.2
        while True:
            for peer in self.peers(item.storage):  # the next k that take it
                if copies == self.k:
                    return copies
                if peer["node"] in tried:
                    continue
                tried.add(peer["node"])
                try:
                    copies += self._send(peer, item)
                except (OSError, ValueError, KeyError) as e:
                    log.warning("ckptd agent: no copy of rank %d step %d on node %s: %s",
                                item.rank, item.step, peer.get("node"), e)
            if (copies >= self.k or time.monotonic() > deadline or not self._queue.empty()
                    or self.stopping.is_set()):
                return copies
            self.stopping.wait(pause)  # until another node announces itself
            pause = min(2 * pause, 5.0)

    def _send(self, peer: dict[str, Any], item: Outgoing) -> bool:
        """One copy to ``peer``: True if it holds it now, False if it had no room."""
        header = {"spec": item.spec, "origin": self.node, "rank": item.rank, "step": item.step,
                  "files": {p: len(m) for p, m in item.files.items()}}
        if not self._transfer(peer, header, list(item.files.values()), self.rate):
            log.warning("ckptd agent: node %s has no room for rank %d step %d: skipped",
                        peer["node"], item.rank, item.step)
            return False
        log.info("ckptd agent: rank %d step %d copied to node %s", item.rank, item.step,
                 peer["node"])
        return True

    def hand_off(self, storage: Storage, spec: dict[str, Any], job: dict[str, Any],
                 staged: memoryview, rank: int, step: int,
                 within_s: float = float("inf")) -> str | None:
        """Give a save this (stopping) agent cannot write in time to the first agent of the
        ring that takes it: the job (JSON) and its staged bytes, which the receiver writes and
        commits like its own. The node that holds it now, or None (none would: write it here).
        Not rate-limited: it races the grace window, ``within_s`` from now, which bounds every
        socket operation (a peer that stops answering cannot hold the save past it)."""
        header = {"op": "handoff", "spec": spec, "origin": self.node, "rank": rank,
                  "step": step, "job": job, "files": {"arena": len(staged)}}
        deadline = time.monotonic() + within_s
        for peer in self.peers(storage):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("ckptd agent: no grace left to hand off rank %d step %d", rank, step)
                break
            try:
                if self._transfer(peer, header, [staged], None, deadline=deadline):
                    log.warning("ckptd agent: rank %d step %d handed to node %s (%d bytes): "
                                "it writes and commits it", rank, step, peer["node"],
                                len(staged))
                    return str(peer["node"])
                log.warning("ckptd agent: node %s did not take rank %d step %d", peer["node"],
                            rank, step)
            except (OSError, ValueError, KeyError) as e:
                log.warning("ckptd agent: hand-off of rank %d step %d to node %s failed: %s",
                            rank, step, peer.get("node"), e)
        return None

    def _transfer(self, peer: dict[str, Any], header: dict[str, Any],
                  parts: list[memoryview], rate: float | None,
                  deadline: float | None = None) -> bool:
        """``header`` then ``parts`` to ``peer`` (at most ``rate`` bytes/s; 60 s for each
        socket operation, and all of it before the monotonic ``deadline`` if given): True once
        it holds them, False if it refused them (no room, or stopping)."""

        def timeout() -> float:
            left = 60.0 if deadline is None else min(60.0, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"node {peer['node']}: out of time")
            return left

        def bound(s: socket.socket) -> None:
            s.settimeout(timeout())

        with socket.create_connection((peer["host"], int(peer["port"])),
                                      timeout=timeout()) as s:
            bound(s)
            answer_challenge(s, self.secret, f"node {peer['node']} refused this agent")
            wire.send(s, header)
            if not wire.recv(s, 4096).get("ok"):
                return False
            t0 = time.monotonic()
            sent = 0
            for mem in parts:
                for i in range(0, len(mem), 4 << 20):
                    part = mem[i: i + (4 << 20)]
                    bound(s)
                    s.sendall(part)
                    sent += len(part)
                    if rate:  # pace to the rate limit
                        ahead = sent / rate - (time.monotonic() - t0)
                        if ahead > 0:
                            time.sleep(ahead)
            bound(s)
            if not wire.recv(s, 4096).get("ok"):
                raise ConnectionError(f"node {peer['node']} did not store it")
            self.sent += sent
            return True


__all__ = ["Outgoing", "PeerReads", "PeerServer", "Replicator", "answer_challenge",
           "job_secret"]
