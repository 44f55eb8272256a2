"""The node agent's gate on one save's writes: its pace (``$CKPTD_AGENT_WRITE_RATE``) and its
stop (a SIGTERMed agent hands the rest of a save to the peer that holds its copy)."""

from __future__ import annotations

import threading
import time

from ckptd.writer.job import Interrupted


class Gate:
    """What the agent's I/O threads pass before each block the storage writes of one save's
    files (64 MiB on a filesystem, a part on S3; before each file too): a pace (at most ``rate``
    bytes/s over the write, ``$CKPTD_AGENT_WRITE_RATE``; None: no limit) and a stop
    (:meth:`stop`: the next block of every file raises
    :class:`~ckptd.writer.job.Interrupted`, a pace's wait ends at
    once; a block being written finishes, the file stays unfinished)."""

    def __init__(self, rate: float | None = None) -> None:
        self.rate = rate
        self.started = 0  # bytes past the gate (being written, or written)
        self._booked = 0  # bytes that came to it (the pace's schedule)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def __call__(self, nbytes: int) -> None:
        with self._lock:  # each block's turn comes once the blocks before it had theirs
            due = self._t0 + self._booked / self.rate if self.rate else 0.0
            self._booked += nbytes
        wait = due - time.monotonic()
        if self._stop.wait(wait) if wait > 0 else self._stop.is_set():
            raise Interrupted("the agent stopped this write")
        with self._lock:
            self.started += nbytes

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()


__all__ = ["Gate"]
