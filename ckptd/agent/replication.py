"""Peer copies: each agent sends its node's newest steps to ``k`` other agents of the same job, so
that a node lost with its memory is read from a peer's memory, not from storage.

* **Who**: agents of one job, through :mod:`ckptd.agent.peer_wire` (the job secret's challenge;
  it also serves what the peers send and read).
* **Where**: an agent that serves a root registers itself at ``_agents/<node>.json`` under that
  root (host, port), and sends to the ``k`` nodes after its own in the sorted list of registered
  nodes (a ring), ``$CKPTD_PEER_COPIES`` (default 1). Its address is ``$CKPTD_AGENT_HOST``
  (default 127.0.0.1: set it to the node's cluster address).
* **When**: after the step is committed and the trainer told (``$CKPTD_PEER_COPY=committed``,
  the default), or as soon as it is staged, while it is being written
  (``$CKPTD_PEER_COPY=staged``: the receiver holds it as uncommitted, beside the committed copy
  before it, until a notice says it committed); on a thread of its own, at most
  ``$CKPTD_PEER_RATE`` bytes/s (default unlimited): replication never waits for, or holds up,
  the trainer. A copy that does not fit the receiver's memory budget is skipped with a warning.
* **Hand-off**: a stopping agent (SIGTERM) whose node cannot write a save inside the grace left
  sends that save's job and staged bytes to the next agent of the ring that is not stopping,
  which writes it (files, partial, on rank 0 the commit) as if its own trainer had staged it
  (:meth:`Replicator.hand_off`, ``docs/agent.md``). A save it was writing already, whose staged
  copy a peer holds, it stops between two blocks and asks that peer to write from the copy
  (:meth:`ckptd.agent.peer_service.PeerService.write_held`: only the job travels).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ckptd import config
from ckptd.agent import wire
from ckptd.agent.peer_wire import NoAnswer, answer_challenge, answer_to, ask
from ckptd.errors import CkptdError
from ckptd.storage import Storage

log = logging.getLogger("ckptd.agent")

REGISTRY = "_agents"
RETRY_S = 60.0  # how long a copy waits for peers to announce themselves
NOTICE_TIMEOUT_S = 10.0  # a commit notice, per peer: connecting and each socket operation


def said_nothing(rank: int, step: int, e: NoAnswer) -> None:
    """A peer got a save of ``rank`` and never said whether it writes it (:class:`NoAnswer`)."""
    log.warning("ckptd agent: rank %d step %d: %s; it may be writing it, so no other node does "
                "(two writers of one share could tear a step one of them commits)", rank, step,
                e)


def copy_when() -> str:
    """``$CKPTD_PEER_COPY``: ``committed`` (the default) or ``staged``."""
    try:
        return config.PEER_COPY.get()
    except CkptdError as e:
        log.warning("ckptd agent: %s: copies are sent once committed", e)
        return "committed"


@dataclass(eq=False)
class Outgoing:
    """One rank's files of one step, to be sent to the peers."""

    spec: dict[str, Any]
    storage: Storage
    rank: int
    step: int
    files: dict[str, memoryview]  # path -> bytes (views of the kept arena)
    done: Callable[[], None]  # sent or given up: the arena may be used again
    committed: bool = True  # False: sent while being written; a Notice follows the commit
    run: str = ""  # the run that saved it (the receiver orders steps by run and number)
    holders: list[dict[str, Any]] = field(default_factory=list)  # the peers that took it
    cancel: threading.Event = field(default_factory=threading.Event)  # its step failed
    finished: threading.Event = field(default_factory=threading.Event)  # sent or given up

    def __str__(self) -> str:
        return f"peer copy of rank {self.rank} step {self.step}"

    def abandon(self, timeout_s: float = 60.0) -> None:
        """Stop sending (the save failed: the trainer gets its arena back) and wait until the
        replicator no longer reads it."""
        self.cancel.set()
        if not self.finished.wait(timeout_s):
            log.warning("ckptd agent: rank %d step %d: the peer copy did not stop in %.0f s",
                        self.rank, self.step, timeout_s)


@dataclass(eq=False)
class Notice:
    """A copy sent while its step was being written (``copy.committed`` False) has committed:
    tell the peers that took it, after the copy itself (one queue, in order)."""

    copy: Outgoing

    def __str__(self) -> str:
        return f"commit notice of rank {self.copy.rank} step {self.copy.step}"


class Replicator:
    """Sends each kept step to the next ``k`` registered nodes, one at a time, in the
    background; a newer step of the same rank replaces one still waiting."""

    def __init__(self, node: str, secret: bytes, address: tuple[str, int], k: int,
                 rate: float | None, stopping: threading.Event | None = None) -> None:
        self.node, self.secret, self.address, self.k, self.rate = node, secret, address, k, rate
        self.stopping = stopping or threading.Event()  # then no more waiting for new peers
        self._queue: queue.Queue[Outgoing | Notice] = queue.Queue()
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

    def submit(self, item: Outgoing | Notice) -> None:
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
                if isinstance(item, Notice):
                    self._notify(item.copy)
                elif not item.cancel.is_set():
                    copies = self._replicate(item)
                    if copies < self.k:
                        log.warning("ckptd agent: rank %d step %d has %d of %d peer copies",
                                    item.rank, item.step, copies, self.k)
            except Exception as e:  # noqa: BLE001 - a copy is a bonus: storage has the step
                log.warning("ckptd agent: %s failed: %s", item, e)
            finally:
                if isinstance(item, Outgoing):
                    item.done()
                    item.finished.set()
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
                    or self.stopping.is_set() or item.cancel.is_set()):
                return copies
            self.stopping.wait(pause)  # until another node announces itself
            pause = min(2 * pause, 5.0)

    def _send(self, peer: dict[str, Any], item: Outgoing) -> bool:
        """One copy to ``peer``: True if it holds it now, False if it had no room."""
        header = {"spec": item.spec, "origin": self.node, "rank": item.rank, "step": item.step,
                  "run": item.run,
                  "files": {p: len(m) for p, m in item.files.items()},
                  "committed": item.committed}
        if not self._transfer(peer, header, list(item.files.values()), self.rate,
                              cancel=item.cancel):
            log.warning("ckptd agent: node %s has no room for rank %d step %d: skipped",
                        peer["node"], item.rank, item.step)
            return False
        item.holders.append(peer)
        log.info("ckptd agent: rank %d step %d copied to node %s%s", item.rank, item.step,
                 peer["node"], "" if item.committed else " (not committed yet)")
        return True

    def _notify(self, copy: Outgoing) -> None:
        """Tell each peer that holds ``copy`` that its step committed: it then keeps it as the
        newest committed step of that rank (and drops the one before)."""
        notice = {"op": "committed", "spec": copy.spec, "origin": self.node, "rank": copy.rank,
                  "step": copy.step}
        for peer in copy.holders:
            try:
                if ask(self.secret, peer, notice, NOTICE_TIMEOUT_S) is None:
                    raise ConnectionError("unreachable")
            except (OSError, ValueError) as e:
                log.warning("ckptd agent: node %s was not told that rank %d step %d committed "
                            "(it keeps the step before too): %s", peer.get("node"), copy.rank,
                            copy.step, e)

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
            except NoAnswer as e:
                said_nothing(rank, step, e)
                return str(peer["node"])
            except (OSError, ValueError, KeyError) as e:
                log.warning("ckptd agent: hand-off of rank %d step %d to node %s failed: %s",
                            rank, step, peer.get("node"), e)
        return None

    def _transfer(self, peer: dict[str, Any], header: dict[str, Any],
                  parts: list[memoryview], rate: float | None,
                  deadline: float | None = None,
                  cancel: threading.Event | None = None) -> bool:
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
            digest = xxhash.xxh3_64()  # of everything sent: the receiver checks it
            for mem in parts:
                for i in range(0, len(mem), 4 << 20):
                    if cancel is not None and cancel.is_set():
                        raise ConnectionError("its save failed: copy abandoned")
                    part = mem[i: i + (4 << 20)]
                    digest.update(part)
                    bound(s)
                    s.sendall(part)
                    sent += len(part)
                    if rate:  # pace to the rate limit
                        ahead = sent / rate - (time.monotonic() - t0)
                        if ahead > 0:
                            time.sleep(ahead)
            bound(s)
            wire.send(s, {"xxh3": digest.hexdigest()})
            reply = answer_to(s, peer["node"], "all of it")  # from here on it may act on it
            if not reply.get("ok"):
                raise ConnectionError(f"node {peer['node']} did not store it: "
                                      f"{reply.get('error', 'no reason given')}")
            self.sent += sent
            return True


__all__ = ["Notice", "Outgoing", "Replicator", "copy_when", "said_nothing"]
