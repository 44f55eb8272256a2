"""The commits the agent's own rank-0 jobs make, for the other ranks of its node.

Every rank but 0 learns that its save committed by waiting for the manifest (a watch on the
step's directory, a probe, a read of the manifest's lead: ``ckptd.writer.commit.wait_committed``)
and then tells its agent so (the ``committed`` message). On the node whose agent coordinates
— it runs rank 0's job — both are work the agent can save its trainers: when a rank's job there
ends while rank 0's job of the same attempt runs in the same agent, the job waits for that
commit and its reply says how it went (sent by the thread that ends rank 0's job, for every
rank waiting), and the agent marks the rank's kept step committed itself. A trainer told
``committed`` neither waits nor sends; one told nothing (the commit failed, rank 0's job came
after, or is another node's) waits as before. At eight ranks a node the node's seven other
trainers save a watch, a wake-up and a message each per save.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future

Key = tuple[str, int, str]  # (the root's key, step, attempt)


class Commits:
    """Rank-0 jobs running here (their outcome to come) and the newest ones that ended."""

    KEEP = 64  # ended commits remembered, for a rank whose job ends just after rank 0's

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: collections.OrderedDict[Key, Future[bool]] = collections.OrderedDict()

    def expect(self, key: Key) -> Future[bool]:
        """Rank 0's job of ``key`` arrived here: its outcome, to be set True once it committed
        (False: it failed, or a peer's agent commits it)."""
        outcome: Future[bool] = Future()
        with self._lock:
            self._outcomes[key] = outcome
            self._outcomes.move_to_end(key)
            while len(self._outcomes) > self.KEEP:
                self._outcomes.popitem(last=False)
        return outcome

    def when_ended(self, key: Key, then: Callable[[bool], None]) -> bool:
        """Call ``then(committed)`` once rank 0's job of ``key`` in this agent has ended —
        in the thread that ends it, right after its commit (or at once, here, if it ended
        already); ``committed``: whether it committed. False, and nothing called, when no
        such job arrived here before (another node's agent coordinates, or it comes later).
        ``then`` must not raise."""
        with self._lock:
            outcome = self._outcomes.get(key)
        if outcome is None:
            return False
        outcome.add_done_callback(lambda f: then(f.result()))
        return True


__all__ = ["Commits", "Key"]
