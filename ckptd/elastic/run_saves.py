"""An elastic run's saves: those still in flight, and what the finished ones taught — the
newest committed step, the newest save asked for, and this rank's write bandwidth, from which
a preemption save projects how long it would take (:meth:`ckptd.elastic.ElasticRun.
save_on_preemption`)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout

from ckptd.writer.handle import Phase, SaveHandle

log = logging.getLogger("ckptd.elastic")


class RunSaves:
    """The saves of one incarnation of a run, in the order asked for."""

    def __init__(self, committed_step: int | None) -> None:
        self.committed_step = committed_step  # the newest step known committed
        self.issued_step = committed_step  # the newest save asked for
        self.newest: SaveHandle | None = None
        self.bandwidth: float | None = None  # bytes/s of this rank's last committed save
        self._pending: list[tuple[int, SaveHandle]] = []

    def issued(self, step: int, handle: SaveHandle) -> None:
        """A save of ``step`` was asked for."""
        self._pending.append((step, handle))
        self.issued_step, self.newest = step, handle

    def observe(self) -> None:
        """Learn from finished saves: the committed step and this rank's write bandwidth."""
        pending = []
        for step, h in self._pending:
            if not h.done():
                pending.append((step, h))
            elif h.phase is Phase.COMMITTED:
                r = h.result()
                self.committed_step = max(self.committed_step or step, step)
                if r.nbytes and r.stall_s + r.write_s > 0:
                    self.bandwidth = r.nbytes / (r.stall_s + r.write_s)
        self._pending = pending

    def drain(self, timeout: float | None) -> bool:
        """Wait for the saves in flight (their errors are logged, and count as reported);
        False when one is still writing after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        for step, h in self._pending:
            try:
                h.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                return False
            except Exception as e:  # noqa: BLE001 - this save failed; the next may not
                log.error("ckptd: the in-flight save of step %d failed: %s", step, e)
        self.observe()
        return True


__all__ = ["RunSaves"]
