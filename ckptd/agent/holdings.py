"""What a node agent holds in host memory, under one budget: the trainers' arenas, the newest
steps it keeps (each in the arena it was staged in) and the peer copies it received.

A kept step belongs to its trainer's session until that session ends (then to the agent alone).
Per rank the agent keeps the newest ``keep_in_memory`` *committed* steps, and up to as many newer
steps whose commit it has not seen yet (rank 0's agent commits itself; the others learn it from
their trainer, which waits for the commit anyway): a node lost while a save is in flight leaves
that step uncommitted, and the restart loads the committed one — from memory. Peer copies
alike: one sent before its step committed (``CKPTD_PEER_COPY=staged``) counts as uncommitted
until its sender's notice (one more of them than of its own steps: see :meth:`Holdings._trim`).
An older step is dropped once a newer one is known committed: given back to its trainer (the
arena is staged into again) or, if the trainer is gone, removed. A step that is still being sent
to a peer, or read by a load, is given back only once the copy is sent and the load done.

Across the ranks of a root, once the run that owns it (``owner.json``) has committed
``keep_in_memory`` steps the agent holds, every step older than those is dropped too, whoever it
belongs to: own or a copy, committed or not, of a rank of this world or of an earlier run (a lost
node's copies, a larger world's ranks). No restart loads it: "latest" is the newest committed
step in commit order, and the owner's steps come after every earlier owner's whatever their
numbers. Until the owner has committed that many, nothing is dropped this way (a restart may still
need an earlier run's step).

The budget counts every segment the agent created and has not removed; beside it, a new segment
must leave the node (or its container) a reserve of free memory (:mod:`ckptd.agent.node_memory`),
which the trainers' own memory also draws on. An arena over either is refused after the orphaned
steps (their trainers gone) are dropped; a peer copy over either is skipped. ``docs/agent.md``
gives the multiplier: per rank ``max_inflight + keep_in_memory`` arenas (one more while a peer
copy is being sent), plus the peer copies received.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptd.agent import node_memory
from ckptd.agent.shm import Segment, shm_space, unlink
from ckptd.agent.wire import root_key
from ckptd.errors import CkptdError

if TYPE_CHECKING:
    from ckptd.agent.replication import Outgoing


class OverBudget(CkptdError, MemoryError):
    """The agent's memory budget cannot hold this segment."""


@dataclass(eq=False)
class HeldStep:
    step: int
    segment: Segment
    files: dict[str, tuple[int, int]]  # path -> [start, end) in the segment
    owner: Any | None  # the session whose arena it is; None: the agent's alone
    seg_id: int  # the arena's id in that session
    pins: int = 0  # peer copies being sent from it, loads reading it
    dropped: bool = False  # past keep_in_memory, waiting for a copy to finish
    origin: str | None = None  # a peer copy: the node it is a copy of; None: this node's own
    committed: bool = False  # the agent saw its step commit (a peer copy: its sender did)
    run: str = ""  # the run that saved it (its steps are in order by number; runs by owner)
    copy: Outgoing | None = None  # its copy to the peers, once sent (before its commit if
    # ``copy.committed`` is False: ``CKPTD_PEER_COPY=staged``)


class Holdings:
    def __init__(self, keep: int, budget: int | None,
                 give_back: Callable[[Any, int], None],
                 owner_of: Callable[[dict[str, Any]], str | None] = lambda spec: None,
                 host: Callable[[], tuple[int, int] | None] = node_memory.left,
                 shm: Callable[[], tuple[int, int] | None] = shm_space) -> None:
        """``give_back(owner, seg_id)``: tell a live session that its arena is free again;
        ``owner_of(spec)``: the run that owns the root now (None: unknown), asked when a step of
        another run than the owner last learnt arrives or commits; ``host()``: the node's
        memory, total and left (:func:`ckptd.agent.node_memory.left`), of which a new segment must
        leave the reserve (``CKPTD_AGENT_MEM_RESERVE``)."""
        self.keep_n, self.budget, self._give_back, self._owner_of = (keep, budget, give_back,
                                                                     owner_of)
        self._host, self._shm = host, shm
        known = host()
        self.reserve = node_memory.reserve(known[0]) if known is not None else 0
        space = shm()
        self.shm_reserve = node_memory.shm_reserve(space[0]) if space is not None else 0
        self.used = 0
        self._kept: dict[tuple[str, int], list[HeldStep]] = {}  # (root, rank) -> newest last
        self._owner: dict[str, str] = {}  # root -> the run that owns it, as last learnt
        # root -> the runs that owned it before (bounded: runs of one root are few; the older
        # half goes past 64); a run never seen as owner may be the next one, not yet claimed
        self._former: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ segments
    def create(self, nbytes: int, tag: str) -> Segment:
        """A new segment, if the budget holds it and the node keeps its reserve after it (both
        tried again after the steps of trainers that are gone are dropped); else OverBudget."""
        with self._lock:
            short = self._short_locked(nbytes, 0)
            if short is not None:
                short = self._short_locked(nbytes, self._drop_orphans_locked())
            if short is not None:
                raise OverBudget(short)
            self.used += nbytes
        try:
            return Segment.create(nbytes, tag)
        except BaseException:
            with self._lock:
                self.used -= nbytes
            raise

    def forget(self, segment: Segment) -> None:
        """Remove a segment's name and stop counting it (mappings stay valid until dropped)."""
        unlink(segment.path)
        with self._lock:
            self.used -= segment.nbytes

    def _short_locked(self, nbytes: int, freed: int) -> str | None:
        """Why ``nbytes`` more do not fit (None: they do), ``freed`` bytes just given back."""
        if self.budget is not None and self.used + nbytes > self.budget:
            return (f"{nbytes} bytes more would put the agent at {self.used + nbytes} of its "
                    f"{self.budget}-byte budget")
        host = self._host()
        if host is not None and host[1] + freed - nbytes < self.reserve:
            return (f"{nbytes} bytes more would leave {max(0, host[1] + freed - nbytes)} bytes "
                    f"of the node's memory free, under the agent's {self.reserve}-byte reserve "
                    "(CKPTD_AGENT_MEM_RESERVE)")
        shm = self._shm()
        if shm is not None and shm[1] + freed - nbytes < self.shm_reserve:
            return (f"{nbytes} bytes more would leave {max(0, shm[1] + freed - nbytes)} of the "
                    f"{shm[0]} bytes of shared memory (/dev/shm) free, under the "
                    f"{self.shm_reserve} bytes the agent leaves to the training processes "
                    "(CKPTD_AGENT_SHM_RESERVE)")
        return None

    def _drop_orphans_locked(self) -> int:
        """Drop the steps whose trainers are gone (and no copy or load holds); the bytes freed."""
        freed = 0
        for kept in self._kept.values():
            for k in [k for k in kept if k.owner is None and not k.pins]:
                kept.remove(k)
                unlink(k.segment.path)
                self.used -= k.segment.nbytes
                freed += k.segment.nbytes
        return freed

    # ------------------------------------------------------------------ kept steps
    def keep(self, spec: dict[str, Any], rank: int, kept: HeldStep) -> list[int]:
        """Keep ``kept`` as the newest step of ``rank``; the arenas of ``kept.owner`` that are
        free again at once."""
        root = root_key(spec)
        self._learn_owner(spec, root, kept.run)
        with self._lock:
            steps = self._kept.setdefault((root, rank), [])
            steps.append(kept)
            dropped = self._floor(root) + self._trim(steps)
        return [k.seg_id for k in dropped if self._release(k, kept.owner)]

    def owned_by(self, spec: dict[str, Any], run: str) -> None:
        """``run`` owns the root (it just committed there)."""
        with self._lock:
            self._set_owner_locked(root_key(spec), run)

    def _set_owner_locked(self, root: str, run: str | None) -> None:
        old = self._owner.get(root)
        if old is not None and old != run:
            former = self._former.setdefault(root, [])
            if old not in former:
                former.append(old)
                del former[:-64]
        if run is None:
            self._owner.pop(root, None)
        else:
            self._owner[root] = run

    def _learn_owner(self, spec: dict[str, Any], root: str, run: str) -> None:
        """A step of ``run`` is here: if that is not the owner last learnt, ask who owns the
        root now (a new run took it; or ``run`` is an earlier one: a copy that came late, a
        trainer of a run that lost the root). Unknown: nothing is dropped across runs."""
        with self._lock:
            if not run or self._owner.get(root) == run:
                return
        owner = self._owner_of(spec)  # outside the lock: it may read storage
        with self._lock:
            self._set_owner_locked(root, owner)

    def commit_seen(self, spec: dict[str, Any], rank: int, step: int,
                  caller: Any) -> tuple[HeldStep | None, list[int]]:
        """``rank``'s ``step`` committed: the kept step (None if not held) and the arenas of
        ``caller`` that are free again (older steps dropped)."""
        found, dropped = self._mark_committed(spec, rank, step, None, once=True)
        if found is not None and found.dropped:  # older than what the root committed since
            found = None
        return found, [k.seg_id for k in dropped if self._release(k, caller)]

    def peer_committed(self, spec: dict[str, Any], origin: str, rank: int, step: int) -> bool:
        """Node ``origin``'s copy of ``rank``'s ``step``, received before its commit, has
        committed: keep it as that rank's newest committed step (the copy before it is
        removed). False if it is not held (any more)."""
        found, dropped = self._mark_committed(spec, rank, step, origin, once=False)
        for k in dropped:
            self._release(k)
        return found is not None

    def _mark_committed(self, spec: dict[str, Any], rank: int, step: int, origin: str | None,
                        once: bool) -> tuple[HeldStep | None, list[HeldStep]]:
        """Mark the newest kept ``step`` of ``rank`` from ``origin`` committed (an older run's
        step of that number comes first) and drop what that makes older; (None, []) if not held
        (or, ``once``, already marked)."""
        root = root_key(spec)
        with self._lock:
            steps = self._kept.get((root, rank), [])
            found = next((k for k in reversed(steps) if k.step == step and k.origin == origin),
                         None)
            if found is None or (once and found.committed):
                return None, []
            found.committed = True
        self._learn_owner(spec, root, found.run)
        with self._lock:
            return found, self._floor(root) + self._trim(steps)

    def _trim(self, steps: list[HeldStep]) -> list[HeldStep]:
        """Drop from one rank's ``steps`` (oldest first) all but the newest ``keep_n`` committed
        steps and the newest unconfirmed steps after them: ``keep_n`` of its own (its trainer's
        arenas), one more of a peer's copies (a sender with ``max_inflight=2`` sends the next
        step's before it can tell that this one committed). Returns the dropped ones."""
        done = [k for k in steps if k.committed][-self.keep_n:]
        newest = max((steps.index(k) for k in done), default=-1)
        later = [k for k in steps[newest + 1:] if not k.committed]
        pending = [k for k in later if k.origin is not None][-self.keep_n - 1:]
        pending += [k for k in later if k.origin is None][-self.keep_n:]
        return self._drop(steps, [k for k in steps if k not in done and k not in pending])

    def _floor(self, root: str) -> list[HeldStep]:
        """Once the root's owner has committed ``keep_n`` steps held here: drop every step of
        any rank that is older (an earlier owner's, or the owner's before them); returns the
        dropped ones. A run never seen owning the root is not older: it may be the next one,
        whose rank 0 has not claimed the root yet while another rank's step is already here
        (its rank's own trimming bounds what it keeps)."""
        owner = self._owner.get(root)
        lists = [ks for (r, _), ks in self._kept.items() if r == root]
        done = sorted({k.step for ks in lists for k in ks if k.committed and k.run == owner})
        if owner is None or len(done) < self.keep_n:
            return []
        floor, former = done[-self.keep_n], self._former.get(root, [])

        def older(k: HeldStep) -> bool:
            return k.step < floor if k.run == owner else not k.run or k.run in former

        return [k for ks in lists for k in self._drop(ks, [k for k in ks if older(k)])]

    @staticmethod
    def _drop(steps: list[HeldStep], old: list[HeldStep]) -> list[HeldStep]:
        steps[:] = [k for k in steps if k not in old]
        for k in old:
            k.dropped = True
        return old

    def _release(self, k: HeldStep, caller: Any | None = None) -> bool:
        """A dropped step's arena: True if it goes back to ``caller`` (the reply says so)."""
        if k.pins:
            return False  # once the copy is sent, the load done
        if k.owner is None:
            self.forget(k.segment)
            return False
        if k.owner is caller:
            return True
        self._give_back(k.owner, k.seg_id)
        return False

    def pin(self, k: HeldStep, delta: int) -> None:
        """Hold (+1) or let go of (-1) a kept step: a pinned step is not given back to its
        trainer or removed (a peer copy is being sent from it, a load is reading it)."""
        with self._lock:
            k.pins += delta
            done = k.dropped and not k.pins
        if done:
            self._release(k)

    def pin_files(self, spec: dict[str, Any]) -> tuple[list[list[Any]], list[HeldStep]]:
        """``[path, segment, start, end, origin]`` of every data file of the root held in
        memory (``origin``: the node a peer copy is of, or None), with every step they come
        from pinned (the caller unpins them)."""
        root = root_key(spec)
        with self._lock:
            kept = [k for (r, _), ks in self._kept.items() if r == root for k in ks]
            for k in kept:
                k.pins += 1
            files = [[path, k.segment.path, a, b, k.origin] for k in kept
                     for path, (a, b) in k.files.items()]
        return files, kept

    def lookup(self, spec: dict[str, Any], path: str) -> tuple[HeldStep, memoryview] | None:
        """One data file of the root held in memory, pinned (the caller unpins it); None if
        memory does not hold it (any more)."""
        root = root_key(spec)
        with self._lock:
            for (r, _), ks in self._kept.items():
                for k in ks:
                    if r == root and path in k.files:
                        k.pins += 1
                        a, b = k.files[path]
                        return k, k.segment.view()[a:b]
        return None

    def held_copy(self, spec: dict[str, Any], origin: str, rank: int, step: int) -> HeldStep | None:
        """The peer copy of ``origin``'s ``rank`` ``step`` held here, pinned (the caller
        unpins it); None if not held (any more)."""
        with self._lock:
            for k in reversed(self._kept.get((root_key(spec), rank), [])):
                if k.origin == origin and k.step == step and not k.dropped:
                    k.pins += 1
                    return k
        return None

    def roots(self) -> dict[str, tuple[int, int]]:
        """Each root (its key) with steps held: their bytes and how many (all ranks, copies
        included)."""
        out: dict[str, tuple[int, int]] = {}
        with self._lock:
            for (root, _), ks in self._kept.items():
                n, steps = out.get(root, (0, 0))
                out[root] = (n + sum(k.segment.nbytes for k in ks), steps + len(ks))
        return {r: v for r, v in out.items() if v[1]}

    def release(self, root: str) -> int:
        """Let go of every step of ``root`` (no restart will load them): given back to a trainer
        still connected, removed otherwise; one a copy or a load holds goes once it is done.
        The bytes removed now."""
        with self._lock:
            dropped = [k for (r, _), ks in self._kept.items() if r == root
                       for k in self._drop(ks, list(ks))]
            before = self.used
        for k in dropped:
            self._release(k)
        with self._lock:
            return before - self.used

    def is_kept(self, segment: Segment) -> bool:
        with self._lock:
            return any(k.segment is segment for ks in self._kept.values() for k in ks)

    def orphan(self, owner: Any) -> None:
        """``owner``'s session ended: its kept steps are the agent's alone."""
        with self._lock:
            for k in [k for ks in self._kept.values() for k in ks if k.owner is owner]:
                k.owner = None

    def close(self) -> None:
        with self._lock:
            for k in [k for ks in self._kept.values() for k in ks]:
                unlink(k.segment.path)
            self._kept.clear()


__all__ = ["HeldStep", "Holdings", "OverBudget"]
