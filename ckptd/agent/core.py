"""What the node agent's parts — one trainer's session (:mod:`.session`), the side facing the
other agents (:mod:`.peer_service`) — use of the agent (:class:`ckptd.agent.server.Agent`), declared
here so that they depend on this seam, not on the process that owns them (which imports them:
a cycle otherwise).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ckptd.agent.commits import Commits
from ckptd.agent.gate import Gate
from ckptd.agent.holdings import HeldStep, Holdings
from ckptd.agent.orphans import JobKey, Shares
from ckptd.agent.peer_wire import PeerServer
from ckptd.agent.replication import Outgoing, Replicator
from ckptd.agent.upkeep import Upkeep
from ckptd.storage import Storage
from ckptd.writer.partial_groups import Groups


@dataclass(eq=False)
class Flight:
    """One save being written by this agent."""

    nbytes: int
    gate: Gate
    copy: Outgoing | None  # its staged copy, sent to the peers while it is written

    @property
    def left(self) -> int:
        """Its bytes not written, nor being written."""
        return self.nbytes - self.gate.started


class PeerSide(Protocol):
    """What a session asks of the agent's side facing its peers (:class:`ckptd.agent.peer_service.
    PeerService`)."""

    server: PeerServer | None
    replicator: Replicator | None

    def hand_off(self, spec: dict[str, Any], job: dict[str, Any], staged: memoryview,
                 rank: int, step: int) -> str | None: ...

    def replicate_staged(self, spec: dict[str, Any], rank: int, kept: HeldStep
                         ) -> Outgoing | None: ...

    def step_committed(self, spec: dict[str, Any], rank: int, kept: HeldStep) -> None: ...

    def write_held(self, spec: dict[str, Any], job: dict[str, Any],
                   copy: Outgoing) -> str | None: ...


class AgentCore(Protocol):
    """The agent as its parts see it: its memory and housekeeping, the saves it writes and
    their grace window, its storages, its peers."""

    node: str
    paths: dict[str, str]
    keep_in_memory: int
    idle_exit_s: float
    holdings: Holdings
    upkeep: Upkeep
    shares: Shares
    stopping: threading.Event
    partial_groups: Groups  # its jobs' partials share frame tables
    commits: Commits  # its rank-0 jobs' commits, for its other ranks' replies

    @property
    def peer_side(self) -> PeerSide: ...

    def tag(self, what: str) -> str: ...

    def storage(self, spec: dict[str, Any]) -> Storage: ...

    def gate(self) -> Gate: ...

    def writing(self, flight: Flight) -> contextlib.AbstractContextManager[Flight]: ...

    def book_write(self, nbytes: int, *, force: bool = False) -> bool: ...

    def unbook_write(self, nbytes: int) -> None: ...

    def grace_left(self) -> float: ...

    def grace_check(self, spec: dict[str, Any], rank: int, nbytes: int,
                    write_s: float) -> str | None: ...

    def give_up(self, spec: dict[str, Any], job: JobKey) -> Callable[[list[int]], str | None]:
        ...

    def job_started(self, job: JobKey) -> None: ...

    def job_ended(self, job: JobKey) -> None: ...

    def wait_idle(self, timeout_s: float, but: str | None = None) -> int: ...

    def session_ended(self, session: Any) -> None: ...

    def stop(self) -> None: ...

    def retire(self, why: str) -> None: ...

    def status(self) -> dict[str, Any]: ...


__all__ = ["AgentCore", "Flight", "PeerSide"]
