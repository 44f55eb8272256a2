"""A pending save, named by its phases: *staged* (the caller may modify the state) and
*committed* (``manifest.json`` names it)."""

from __future__ import annotations

import enum
import threading
from concurrent.futures import Future
from dataclasses import dataclass


class Phase(enum.Enum):
    STAGING = "staging"  # copying the state into host memory; the caller must not modify it
    STAGED = "staged"  # bytes are in host memory; being written in the background
    COMMITTED = "committed"  # manifest.json of this save exists: it is a checkpoint
    FAILED = "failed"  # the save raised; the previous checkpoint is still `latest`
    SKIPPED = "skipped"  # dropped because the previous save was still in flight (on_busy="skip")


@dataclass(frozen=True)
class SaveResult:
    step: int
    url: str
    nbytes: int  # bytes this rank wrote (stored size)
    stall_s: float  # time the caller was blocked (until staged)
    write_s: float  # staged -> committed
    # the node whose agent wrote this rank's share: this node's agent was stopping (SIGTERM) and
    # could not write it inside the grace window (docs/agent.md); None: written here
    handed_to: str | None = None


class SaveHandle:
    """Returned by ``save_async``. ``wait_staged()`` before modifying the state when saving with
    ``overlap=True``; ``result()`` blocks until the step is committed on every rank."""

    def __init__(self, step: int, url: str) -> None:
        self.step = step
        self.url = url
        self.phase = Phase.STAGING
        self.stall_s = 0.0
        self._staged: Future[None] = Future()
        self._committed: Future[SaveResult] = Future()
        self.handed_to: str | None = None  # see SaveResult.handed_to; known before the commit
        self._safe = threading.Event()  # committed, failed, or handed to a peer's agent
        self._reported = False
        self._lock = threading.Lock()
        self.on_wait_staged: list[object] = []

    # -- producer side (the Saver); the first outcome wins, later ones are ignored (an
    # interrupt in the caller may race the save thread's own outcome) --
    def mark_staged(self) -> None:
        with self._lock:
            if self._staged.done():
                return
            self.phase = Phase.STAGED
            self._staged.set_result(None)

    def mark_committed(self, result: SaveResult) -> None:
        with self._lock:
            if self._committed.done():
                return
            self.phase = Phase.COMMITTED
            self._committed.set_result(result)
            self._safe.set()

    def mark_handed(self, node: str) -> None:
        """A peer's agent holds this rank's share and writes it: safe before it is committed."""
        self.handed_to = node
        self._safe.set()

    def mark_failed(self, error: BaseException, *, reported: bool = False) -> None:
        """``reported``: the error is being raised to the caller already (not again later)."""
        with self._lock:
            if self._committed.done():
                return
            self.phase = Phase.FAILED
            self._reported = reported
            if not self._staged.done():
                self._staged.set_exception(error)
            self._committed.set_exception(error)
            self._safe.set()

    def take_error(self) -> BaseException | None:
        """The background error, once: the first caller to take it raises it."""
        if not self._committed.done():
            return None
        error = self._committed.exception()
        with self._lock:
            if error is None or self._reported:
                return None
            self._reported = True
        return error

    def wait_done(self) -> None:
        """Block until committed or failed, without raising (errors go through take_error)."""
        self._committed.exception()

    # -- consumer side --
    def done(self) -> bool:
        return self._committed.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        self._staged.result(timeout)
        for check in self.on_wait_staged:
            check()  # type: ignore[operator]

    def wait_safe(self, timeout: float | None = None) -> bool:
        """Wait until the save is committed, failed, or held by a peer's agent that writes it
        (:attr:`handed_to`); False on timeout. The preemption path waits for this rather than
        the commit: the process may be killed once its share is safe."""
        return self._safe.wait(timeout)

    def result(self, timeout: float | None = None) -> SaveResult:
        try:
            return self._committed.result(timeout)
        except BaseException:
            with self._lock:
                self._reported = True
            raise


class SkippedHandle(SaveHandle):
    def __init__(self, step: int, url: str) -> None:
        super().__init__(step, url)
        self.phase = Phase.SKIPPED
        self._staged.set_result(None)
        self._committed.set_result(SaveResult(step, url, 0, 0.0, 0.0))
