"""The wire between the node agents of one job: who may talk (the job secret and its challenge)
and the serving side (:class:`PeerServer`: peer copies, hand-offs, range reads, questions about
shares) with the loaders' side of range reads (:class:`PeerReads`). What is sent, to whom and
when is :mod:`ckptd.agent.replication`.

* **Whole**: what a peer sends (a copy, a hand-off) is followed by its xxh3 digest; the
  receiver keeps it, or writes it, only if what arrived has the same (a hand-off is written
  with checksums computed here: they must be of the sender's bytes).
* **Silence**: a peer that received a request (all of a hand-off, a write from its copy) and did
  not answer may be acting on it (:class:`NoAnswer`): the sender then leaves the save to it.
* **Who**: agents of one job share a secret (``$CKPTD_JOB_SECRET``, set by the launcher; there is
  no default, and without it there are no peer copies). A connection starts with a challenge: the
  receiver sends a random nonce, the sender answers ``HMAC-SHA256(secret, nonce)``; anything else
  is refused. The data are not trusted either way: the loader verifies every frame's checksum.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import xxhash

from ckptd import config
from ckptd.agent import wire

log = logging.getLogger("ckptd.agent")

# A connection must answer the challenge within HANDSHAKE_S; at most MAX_UNPROVEN may be waiting
# to (more are closed at once): what an unauthenticated flood can hold of the agent's threads
# and file descriptors is bounded by them, whatever the process's limit.
HANDSHAKE_S = 5.0
MAX_UNPROVEN = 64


def job_secret() -> bytes | None:
    return config.JOB_SECRET.get()


def recv_into(sock: socket.socket, into: memoryview) -> None:
    got = 0
    while got < len(into):
        k = sock.recv_into(into[got:], len(into) - got)
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k


def answer_challenge(sock: socket.socket, secret: bytes, refused: str) -> None:
    """The connecting side of the challenge :meth:`PeerServer._handle` poses: the HMAC of its
    nonce; ``ConnectionError(refused)`` if the answer is not accepted."""
    nonce = bytes.fromhex(wire.recv(sock, 4096, max_depth=2)["nonce"])
    wire.send(sock, {"mac": hmac.new(secret, nonce, hashlib.sha256).hexdigest()})
    if not wire.recv(sock, 4096, max_depth=2).get("ok"):
        raise ConnectionError(refused)


class NoAnswer(ConnectionError):
    """The peer got a request (a hand-off, a write from its copy) and its answer did not come:
    it may be acting on it. The sender must not act too (two writers of one share could tear a
    step the other one commits)."""


def answer_to(sock: socket.socket, node: str, what: str) -> dict[str, Any]:
    """The answer to a request ``sock``'s peer has received: :class:`NoAnswer` if none comes."""
    try:
        return wire.recv(sock, 1 << 20)
    except (OSError, ValueError) as e:
        raise NoAnswer(f"node {node} got {what} and did not answer ({e})") from e


def ask(secret: bytes, peer: dict[str, Any], message: dict[str, Any],
        timeout_s: float) -> dict[str, Any] | None:
    """One message to ``peer`` (a registered agent: node, host, port) and its answer; None if
    it cannot be reached (its node is lost); raises when it was reached and did not answer
    (:class:`NoAnswer`, once the message was sent), or answered not ok. ``timeout_s`` bounds
    the connection and each socket operation."""
    try:
        sock = socket.create_connection((peer["host"], int(peer["port"])), timeout=timeout_s)
    except OSError:
        return None
    with sock:
        sock.settimeout(timeout_s)
        answer_challenge(sock, secret, f"node {peer['node']} refused this agent")
        wire.send(sock, message)
        reply = answer_to(sock, peer["node"], f"a {message.get('op')!r} request")
    if not reply.get("ok"):
        raise ConnectionError(f"node {peer['node']}: {reply.get('error', 'no answer')}")
    return reply


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
    awaits (``question["op"] == "holds"``: :mod:`ckptd.agent.orphans`); ``notice(header)``
    learns that a copy sent before its commit has committed (``header["op"] ==
    "committed"``); ``write(header)`` writes a save a stopping peer stopped writing, from the
    copy of it held here (``header["op"] == "write"``)."""

    def __init__(self, secret: bytes, host: str, accept: Accept,
                 lookup: Lookup | None = None, take_over: Accept | None = None,
                 holds: Answer | None = None, notice: Answer | None = None,
                 write: Answer | None = None) -> None:
        self.secret, self._accept, self._lookup = secret, accept, lookup
        self._take_over, self._holds, self._notice = take_over, holds, notice
        self._write = write
        self.sock = socket.create_server((host, 0), backlog=128)
        self.address = self.sock.getsockname()[:2]
        self._closed = False
        self._lock = threading.Lock()
        self._unproven = 0  # connections that have not answered the challenge yet
        self.turned_away = 0  # connections closed at once: MAX_UNPROVEN were waiting already
        self._said = wire.RateLog(log)
        threading.Thread(target=self._serve, name="ckptd-peers", daemon=True).start()

    def _serve(self) -> None:
        """Accept until :meth:`close`, whatever the network throws at the port: an accept that
        fails (out of file descriptors, a connection reset before it was accepted) is logged
        and tried again after a pause; a connection beyond :data:`MAX_UNPROVEN` unauthenticated
        ones is closed at once."""
        pause = 0.0
        while not self._closed:
            try:
                conn, addr = self.sock.accept()
            except OSError as e:
                if self._closed:
                    return
                pause = min(max(2 * pause, 0.05), 2.0)
                self._said.warning("accept", "ckptd agent: the peer port could not accept a "
                                   "connection (%s); trying again in %.2f s", e, pause)
                time.sleep(pause)
                continue
            pause = 0.0
            with self._lock:
                room = self._unproven < MAX_UNPROVEN
                if room:
                    self._unproven += 1
                else:
                    self.turned_away += 1
            if not room:
                conn.close()
                self._said.warning("full", "ckptd agent: %d connections to the peer port are "
                                   "still to answer its challenge; closed one from %s at once "
                                   "(%d in all)", MAX_UNPROVEN, addr[0], self.turned_away)
                continue
            try:
                threading.Thread(target=self._handle, args=(conn, addr), daemon=True).start()
            except RuntimeError as e:  # no thread to be had: refuse this one
                self._proven()
                conn.close()
                self._said.warning("thread", "ckptd agent: a peer connection refused: %s", e)

    def _proven(self) -> None:
        with self._lock:
            self._unproven -= 1

    def _handle(self, conn: socket.socket, addr: Any) -> None:
        finish: Finish | None = None
        proven = False
        with conn:
            try:
                conn.settimeout(HANDSHAKE_S)  # an unauthenticated peer gets a short deadline
                nonce = secrets.token_bytes(32)
                wire.send(conn, {"nonce": nonce.hex()})
                # before authentication: small, shallow
                answer = wire.recv(conn, 4096, max_depth=2).get("mac", "")
                expected = hmac.new(self.secret, nonce, hashlib.sha256).hexdigest()
                if not isinstance(answer, str) or not hmac.compare_digest(answer, expected):
                    self._said.warning(f"refused {addr[0]}", "ckptd agent: refused a peer at "
                                       "%s: not of this job", addr[0])
                    wire.send(conn, {"ok": False, "error": "not of this job"})
                    return
                proven = True
                self._proven()
                conn.settimeout(60)
                wire.send(conn, {"ok": True})
                header = wire.recv(conn, 64 << 20)
                if header.get("op") == "read":
                    self._reads(conn, header)
                    return
                answers = {"holds": self._holds, "committed": self._notice, "write": self._write}
                if header.get("op") in answers:
                    answer_of = answers[header["op"]]
                    wire.send(conn, answer_of(header) if answer_of is not None else
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
                recv_into(conn, into[:total])
                sent = wire.recv(conn, 4096).get("xxh3")  # the sender's digest of what it sent
                whole = sent == xxhash.xxh3_64_hexdigest(into[:total])
                if not whole:
                    log.warning("ckptd agent: node %s's rank %s step %s arrived damaged "
                                "(its checksum differs): dropped", header.get("origin"),
                                header.get("rank"), header.get("step"))
                finish = None
                done(whole)  # kept (or written), or its memory goes back to the budget
                wire.send(conn, {"ok": True} if whole else
                          {"ok": False, "error": "arrived damaged: checksum differs"})
            except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
                what = "a peer copy" if proven else "an unauthenticated connection"
                self._said.warning(f"failed {addr[0]}", "ckptd agent: %s from %s failed: %s",
                                   what, addr[0], e)
                if finish is not None:
                    finish(False)  # its memory goes back to the budget
            finally:
                if not proven:
                    self._proven()

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
        self._closed = True
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
            recv_into(sock, buf)
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


__all__ = ["Accept", "Answer", "Lookup", "NoAnswer", "PeerReads", "PeerServer",
           "answer_challenge", "answer_to", "ask", "job_secret", "recv_into"]
