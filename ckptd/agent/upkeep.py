"""What a node agent does while nobody asks it anything: give back the memory of roots no job
uses, leave when idle, and say what it holds (``ckptd agent --status``).

* A root's kept steps (its own and peer copies) are for a restart of its job. Once no trainer of
  the root is connected and no save of it runs for ``release_s`` (``--release-after``, default
  60 s: a restart under torchrun or a batch system's requeue comes within seconds), they are
  removed, even though the agent may idle on for ``--idle-exit``. A local root whose directory is
  gone (a deleted run) is released at once: nothing can load it.
* The agent exits after ``idle_exit_s`` with no client and no job; at once when idle once it is
  *retiring* (a trainer of another ckptd found it: it serves the trainers it has, no new ones).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ckptd import config
from ckptd.agent.holdings import Holdings

log = logging.getLogger("ckptd.agent")

CHECK_EVERY_S = 1.0


def release_after_s() -> float:
    """``$CKPTD_AGENT_RELEASE_S`` (default 60): how long an unused root's steps stay."""
    return config.AGENT_RELEASE_S.get()


def _local_dir(root: str) -> str | None:
    """The directory of a root key (its spec as JSON) if it is a local path."""
    try:
        url = json.loads(root).get("url")
    except (ValueError, AttributeError):
        return None
    if not isinstance(url, str) or not url:
        return None
    if url.startswith("file://"):
        url = url[len("file://"):]
    return url if "://" not in url and os.path.isabs(url) else None


@dataclass
class Upkeep:
    """One agent's housekeeping: called with what is in use at each tick of its accept loop."""

    holdings: Holdings
    idle_exit_s: float
    release_s: float = field(default_factory=release_after_s)
    retiring: str | None = None  # why, once a trainer of another ckptd asked it to go
    _last_use: dict[str, float] = field(default_factory=dict)  # root -> monotonic time
    _idle_since: float = field(default_factory=time.monotonic)
    _next_check: float = 0.0

    def used(self, roots: set[str], busy: bool, now: float | None = None) -> None:
        """The roots of the connected trainers and running saves, and whether anything is
        (keeps the idle clock at zero)."""
        now = time.monotonic() if now is None else now
        for root in roots:
            self._last_use[root] = now
        if busy:
            self._idle_since = now

    def tick(self, roots: set[str], busy: bool) -> bool:
        """Release what is due; True when the agent should exit now."""
        now = time.monotonic()
        self.used(roots, busy, now)
        if now >= self._next_check:
            self._next_check = now + CHECK_EVERY_S
            self._release(roots, now)
        if busy:
            return False
        if self.retiring is not None:
            log.info("ckptd agent: retiring (%s) and idle: exiting", self.retiring)
            return True
        if now - self._idle_since >= self.idle_exit_s:
            log.info("ckptd agent: idle for %.0f s, exiting", self.idle_exit_s)
            return True
        return False

    def _release(self, active: set[str], now: float) -> None:
        for root in self.holdings.roots():
            local = _local_dir(root)
            last = self._last_use.setdefault(root, now)
            if local is not None and not os.path.isdir(local):
                why = f"{local} is gone"
            elif root not in active and now - last >= self.release_s:
                why = f"no trainer used it for {self.release_s:.0f} s"
            else:
                continue
            freed = self.holdings.release(root)
            if freed:
                log.info("ckptd agent: gave back %d bytes of %s: %s", freed,
                         json.loads(root).get("url"), why)
        for root in [r for r in self._last_use if r not in active and now - self._last_use[r]
                     > 2 * max(self.release_s, CHECK_EVERY_S)]:
            del self._last_use[root]  # nothing held: forget it

    def status(self, active: set[str], busy: int, sessions: int) -> dict[str, Any]:
        """What ``ckptd agent --status`` shows of memory and time."""
        now = time.monotonic()
        roots = []
        for root, (nbytes, steps) in sorted(self.holdings.roots().items()):
            idle = 0.0 if root in active else now - self._last_use.get(root, now)
            roots.append({"url": json.loads(root).get("url"), "bytes": nbytes, "steps": steps,
                          "in_use": root in active,
                          "released_in_s": None if root in active
                          else max(0.0, self.release_s - idle)})
        idle_s = 0.0 if busy or sessions else now - self._idle_since
        return {"roots": roots, "sessions": sessions, "saves_running": busy,
                "idle_s": round(idle_s, 1),
                "exits_in_s": None if busy or sessions else
                round(max(0.0, self.idle_exit_s - idle_s), 1),
                "release_after_s": self.release_s, "retiring": self.retiring}


__all__ = ["Upkeep", "release_after_s"]
