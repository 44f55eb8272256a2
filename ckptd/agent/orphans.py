"""A step whose run was restarted: can the shares its commit still waits for come at all?

Rank 0's agent commits a step once every rank's partial is in (:func:`ckptd.writer.commit.
coordinate`). When a node is lost with a save in flight, its share never comes: the agent would
wait ``commit_timeout_s`` for it, and the restart on rank 0's node waits ``CKPTD_AGENT_DRAIN_S``
for that job before it takes the root over (``docs/agent.md``). Once a newer run of the same
root has started on this node (its Checkpointers ask the agent to drain), the coordinating job
asks every agent registered under the root whether it writes, or may still be sent, a share it
misses:

* an agent **writes** a share while it runs a job (or a hand-off) of that attempt and rank;
* it **may still be sent** one while a trainer of that run and rank is connected to it (the
  old run's trainer on a node that left the job, still saving after its SIGTERM);
* an agent that cannot be reached (its node is lost: the connection is refused or times out)
  writes nothing; one that is reached but does not answer the question counts as a maybe.

No one claims a missing share: the step fails at once, naming the ranks (FAILED marker; the
previous step stays ``latest``), and the drain ends. What this cannot see is a trainer of the
old run that lost its agent and saves in process on a node that left the job: that step is
failed too. Peer questions need the job secret (``CKPTD_JOB_SECRET``): without it an agent
knows no other node, and the job waits as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptd.agent import jobs
from ckptd.agent.peer_wire import ask
from ckptd.agent.replication import Replicator
from ckptd.agent.wire import root_key
from ckptd.storage import Storage

log = logging.getLogger("ckptd.agent")

ASK_EVERY_S = 1.0  # a coordinating job's polls are faster: the question goes out at most this often
ASK_TIMEOUT_S = 5.0  # per peer, connecting and answering
KEEP_RUNS = 64  # runs remembered per root: their order is what "superseded" means


@dataclass(frozen=True)
class JobKey:
    """Whose save a job is: the root, the run, the attempt, the rank."""

    root: str
    run: str
    attempt: str
    rank: int

    @classmethod
    def of(cls, spec: dict[str, Any], job: dict[str, Any]) -> JobKey:
        """From a job message (KeyError, ValueError, TypeError if malformed)."""
        share = job["share"]
        return cls(root_key(spec), jobs.incarnation_of(job["commit"]), str(share["attempt"]),
                   int(share["rank"]))


class Shares:
    """The shares this agent writes or may still be sent, and the runs superseded on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # by attempt or run id and rank, not by root: nodes may name the same storage
        # differently (mount points), and a false claim only means waiting as before
        self._writing: Counter[tuple[str, int]] = Counter()  # (attempt, rank)
        self._connected: Counter[tuple[str, int]] = Counter()  # (run, rank)
        # root -> the runs that asked to drain, in the order they first did (the newest last;
        # the last KEEP_RUNS: a run older than those counts as never seen, and waits)
        self._started: dict[str, list[str]] = {}
        self._asked: dict[str, float] = {}  # attempt -> monotonic time of the last question
        self._told: set[str] = set()  # attempts whose claimant was logged

    def writing(self, attempt: str, rank: int, delta: int) -> None:
        with self._lock:
            self._writing[(attempt, rank)] += delta
            if self._writing[(attempt, rank)] <= 0:
                del self._writing[(attempt, rank)]

    def connected(self, run: str, rank: int, delta: int) -> None:
        with self._lock:
            self._connected[(run, rank)] += delta
            if self._connected[(run, rank)] <= 0:
                del self._connected[(run, rank)]

    def started(self, root: str, run: str) -> None:
        """A run of ``root`` started on this node (its Checkpointers drain before they claim the
        root): every run that started before it is superseded. A run seen already keeps its
        place (its other ranks' Checkpointers drain too)."""
        with self._lock:
            runs = self._started.setdefault(root, [])
            if run not in runs:
                runs.append(run)
                del runs[:-KEEP_RUNS]

    def superseded(self, root: str, run: str) -> bool:
        """Whether a run of ``root`` started on this node after ``run`` did. A run it never saw
        start is not (a false "superseded" fails a step whose share may still come; a false
        "not" only waits, as without peers)."""
        with self._lock:
            runs = self._started.get(root, [])
            return run in runs and run != runs[-1]

    def due(self, attempt: str) -> bool:
        """Whether to ask again about ``attempt`` (at most every ``ASK_EVERY_S``)."""
        now = time.monotonic()
        with self._lock:
            if now - self._asked.get(attempt, -ASK_EVERY_S) < ASK_EVERY_S:
                return False
            self._asked[attempt] = now
            return True

    def forget(self, attempt: str) -> None:
        """``attempt``'s coordinating job ended: what was asked about it goes."""
        with self._lock:
            self._asked.pop(attempt, None)
            self._told.discard(attempt)

    def first_claim(self, attempt: str) -> bool:
        """True the first time a share of ``attempt`` is found claimed (logged once)."""
        with self._lock:
            first = attempt not in self._told
            self._told.add(attempt)
            return first

    def answer(self, question: dict[str, Any]) -> dict[str, Any]:
        """Which of ``question["ranks"]`` this agent writes or may still be sent."""
        run, attempt = str(question["run"]), str(question["attempt"])
        ranks = [int(r) for r in question["ranks"]]
        with self._lock:
            return {"ok": True,
                    "writing": [r for r in ranks if self._writing[(attempt, r)] > 0],
                    "connected": [r for r in ranks if self._connected[(run, r)] > 0]}


def nobody_claims(replicator: Replicator, storage: Storage, local: Shares,
                  question: dict[str, Any]) -> str | None:
    """Why none of the missing ranks' shares can come (the reason for the error), or None if
    one may: this agent or a registered peer writes or awaits one, or a peer that was reached
    did not answer."""
    if not replicator.registered(storage):
        return None  # the other nodes are unknown
    claimant = _claimant(replicator.node, local.answer(question))
    unreachable = []
    if claimant is None:
        peers = replicator.peers(storage)
        with ThreadPoolExecutor(max(1, min(32, len(peers))),
                                thread_name_prefix="ckptd-ask") as pool:
            futures = [pool.submit(ask, replicator.secret, p, question, ASK_TIMEOUT_S)
                       for p in peers]
            for peer, future in zip(peers, futures, strict=True):
                try:
                    reply = future.result()
                except (OSError, ValueError) as e:  # reached, no answer: it may hold one
                    claimant = f"node {peer.get('node')} did not answer ({e})"
                    break
                if reply is None:
                    unreachable.append(str(peer.get("node")))
                elif (claimant := _claimant(str(peer.get("node")), reply)) is not None:
                    break
    if claimant is not None:
        if local.first_claim(str(question["attempt"])):
            log.info("ckptd agent: step of attempt %s: a newer run started, still waiting for "
                     "ranks %s: %s", question["attempt"], question["ranks"], claimant)
        return None
    gone = f"; nodes {unreachable} do not answer" if unreachable else ""
    return (f"run {question['run']} was restarted and no node agent of the job writes or "
            f"awaits their share{gone}")


def _claimant(node: str, answer: dict[str, Any]) -> str | None:
    if answer.get("writing"):
        return f"node {node} writes ranks {answer['writing']}"
    if answer.get("connected"):
        return f"node {node} serves the trainers of ranks {answer['connected']}"
    return None


def give_up(replicator: Replicator | None, storage: Storage, local: Shares,
            job: JobKey) -> Callable[[list[int]], str | None]:
    """For :func:`ckptd.writer.commit.coordinate` of ``job`` (rank 0's): called with the missing
    ranks at each poll; a reason once their shares cannot come (:func:`nobody_claims`), after a
    newer run of the root started on this node."""

    def check(missing: list[int]) -> str | None:
        if (replicator is None or not local.superseded(job.root, job.run)
                or not local.due(job.attempt)):
            return None
        question = {"op": "holds", "run": job.run, "attempt": job.attempt, "ranks": missing}
        return nobody_claims(replicator, storage, local, question)

    return check


__all__ = ["JobKey", "Shares", "give_up", "nobody_claims"]
