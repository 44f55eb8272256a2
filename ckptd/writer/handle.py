"""A pending save, named by its phases: *staged* (the caller may modify the state) and
*committed* (``manifest.json`` names it).

:class:`SaveHandle` is a :class:`concurrent.futures.Future` of the :class:`SaveResult`, and
``handle.staged`` a second Future that completes at the staged point. Only ckptd completes them:
the save thread through the underscored methods below (``set_result``/``set_exception`` are
refused), and the first outcome wins (an interrupt in the caller may race the save thread's own
outcome).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class Phase(enum.Enum):
    """Where a save is (``SaveHandle.phase``).

    Attributes:
        STAGING: copying the state into host memory; the caller must not modify it.
        STAGED: the bytes are in host memory and being written in the background.
        COMMITTED: the step's ``manifest.json`` exists: it is a checkpoint.
        FAILED: the save raised; the previous checkpoint is still the latest.
        SKIPPED: dropped because earlier saves were still in flight (``on_busy="skip"``).

    Example:
        import tempfile
        import torch
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            handle = ckpt.save_async({"w": torch.ones(2)}, step=1)
            handle.result()
            assert handle.phase is ckptd.Phase.COMMITTED
    """

    STAGING = "staging"  # copying the state into host memory; the caller must not modify it
    STAGED = "staged"  # bytes are in host memory; being written in the background
    COMMITTED = "committed"  # manifest.json of this save exists: it is a checkpoint
    FAILED = "failed"  # the save raised; the previous checkpoint is still `latest`
    SKIPPED = "skipped"  # dropped because earlier saves were still in flight (on_busy="skip")


@dataclass(frozen=True)
class SaveResult:
    """What a save did on this rank (``SaveHandle.result()``, ``save()``).

    Attributes:
        step: the step number saved.
        url: the step's directory (``ROOT/step-NNNNNNNNN``).
        nbytes: bytes this rank wrote (stored size, after compression).
        stall_s: seconds the caller was blocked by ``save_async`` (until staged), including
            ``waited_s``.
        write_s: seconds from staged to committed.
        handed_to: the node whose agent wrote this rank's share, when this node's agent was
            stopping (SIGTERM) and could not write it inside the grace window; None: written
            here.
        skipped: True when the save was dropped (``on_busy="skip"`` and earlier saves still in
            flight): nothing was written and ``nbytes`` is 0. A skipped save is not an error.
        waited_s: seconds ``save_async`` waited for earlier saves to finish before staging
            this one (``max_inflight`` saves were in flight; ``on_busy="block"``); 0.0 when
            it did not wait. Also ``wait_s`` in the metrics line.
        executor: what wrote this rank's share: ``"agent"`` (the node agent) or
            ``"process"`` (this process: no agent, a save smaller than
            ``$CKPTD_AGENT_MIN_BYTES``, or the agent was lost). Also in the metrics line.

    Example:
        import tempfile
        import torch
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            result = ckpt.save({"w": torch.ones(2)}, step=1)
        assert result.step == 1 and not result.skipped and result.nbytes > 0
    """

    step: int
    url: str
    nbytes: int
    stall_s: float
    write_s: float
    handed_to: str | None = None
    skipped: bool = False
    waited_s: float = 0.0
    executor: str = "process"


class _Completed(Future[T]):
    """A Future only ckptd completes: ``set_result``/``set_exception`` are refused; the save
    thread calls :meth:`_complete` / :meth:`_fail`. It is running from the start, so
    ``cancel()`` returns False (a save cannot be called off)."""

    def __init__(self) -> None:
        super().__init__()
        self.set_running_or_notify_cancel()

    def set_result(self, result: T) -> None:
        raise RuntimeError("a save's Future is completed by ckptd, not by its caller")

    def set_exception(self, exception: BaseException | None) -> None:
        raise RuntimeError("a save's Future is completed by ckptd, not by its caller")

    def _complete(self, result: T) -> None:
        Future.set_result(self, result)

    def _fail(self, error: BaseException) -> None:
        Future.set_exception(self, error)


class SaveHandle(_Completed[SaveResult]):
    """What ``save_async`` returns: a :class:`concurrent.futures.Future` of the
    :class:`SaveResult`, completed once the step is committed on every rank (or with the
    save's error).

    ``done()``, ``result(timeout)``, ``exception(timeout)``, ``add_done_callback(fn)`` (called
    once, with this handle, on the save thread: keep it short) and
    ``concurrent.futures.wait``/``as_completed`` work as for any Future; ``cancel()`` returns
    False. A save's error is raised once: by ``result()`` (or returned by ``exception()``),
    else by the next ``save_async``, ``wait`` or ``close``.

    Attributes:
        step: the step being saved.
        url: the step's directory.
        staged: a Future that completes (with None) once the state is in host memory, when the
            caller may modify it; with the save's error if staging failed.
        stall_s: seconds ``save_async`` blocked the caller.
        waited_s: seconds of ``stall_s`` spent waiting for earlier saves (see
            :attr:`SaveResult.waited_s`).
        handed_to: see :attr:`SaveResult.handed_to` (known before the commit).

    Example:
        import concurrent.futures
        import tempfile
        import threading
        import torch
        import ckptd

        with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
            handle = ckpt.save_async({"w": torch.ones(2)}, step=1)
            assert isinstance(handle, concurrent.futures.Future)
            called = threading.Event()
            handle.add_done_callback(lambda h: called.set())
            assert handle.result(timeout=60).step == 1
            assert called.wait(60)
    """

    def __init__(self, step: int, url: str) -> None:
        super().__init__()
        self.step = step
        self.url = url
        self.staged: _Completed[None] = _Completed()
        self.stall_s = 0.0
        self.waited_s = 0.0
        self.handed_to: str | None = None
        self._phase = Phase.STAGING
        self._safe = threading.Event()  # committed, failed, or handed to a peer's agent
        self._reported = False  # the error reached the caller (raise it no more)
        self._lock = threading.Lock()
        self._checks: list[Callable[[], Any]] = []  # run by wait_staged (debug_overlap)

    @property
    def phase(self) -> Phase:
        """The save's :class:`Phase` now."""
        return self._phase

    # -- the consumer's side --
    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state is staged (``save_async(..., overlap=True)``: call it before
        modifying the state). ``handle.staged.result(timeout)`` without the check below.

        Args:
            timeout: seconds to wait; None: no limit.

        Raises:
            TimeoutError: not staged within ``timeout``.
            CorruptCheckpoint: with ``debug_overlap``, the state was modified before it was
                staged (naming the tensor).
            CkptdError: staging failed (the save's error).

        Example:
            import tempfile
            import torch
            import ckptd

            with ckptd.Checkpointer(tempfile.mkdtemp()) as ckpt:
                w = torch.ones(2)
                handle = ckpt.save_async({"w": w}, step=1, overlap=True)
                handle.wait_staged()
                w.zero_()  # safe now
                handle.result()
        """
        self.staged.result(timeout)
        for check in self._checks:
            check()

    def wait_safe(self, timeout: float | None = None) -> bool:
        """Wait until the save is committed, failed, or held by a peer's agent that writes it
        (:attr:`handed_to`). The preemption path waits for this rather than the commit: the
        process may be killed once its share is safe.

        Args:
            timeout: seconds to wait; None: no limit.

        Returns:
            True once safe (or failed: see :meth:`result`), False on timeout.
        """
        return self._safe.wait(timeout)

    def result(self, timeout: float | None = None) -> SaveResult:
        """The :class:`SaveResult` once the step is committed on every rank.

        Args:
            timeout: seconds to wait; None: no limit.

        Returns:
            This rank's :class:`SaveResult` (``skipped`` True for a dropped save).

        Raises:
            TimeoutError: not committed within ``timeout`` (the save goes on).
            CkptdError: the save failed (its error, with its class: ``StorageError``, ...);
                it then counts as raised.
        """
        try:
            return super().result(timeout)
        except BaseException:
            if self.done():
                self._reported = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error, once done; it then counts as raised (the next ``save_async``,
        ``wait`` or ``close`` does not raise it again).

        Args:
            timeout: seconds to wait; None: no limit.

        Returns:
            The exception, or None if the save committed (or was skipped).

        Raises:
            TimeoutError: not done within ``timeout``.
        """
        error = super().exception(timeout)
        if error is not None:
            self._reported = True
        return error

    # -- the save thread's side (ckptd's own) --
    def _settle(self, phase: Phase) -> bool:
        """Whether this outcome is the first (and then the phase is ``phase``)."""
        with self._lock:
            if self._phase in (Phase.COMMITTED, Phase.FAILED, Phase.SKIPPED):
                return False
            self._phase = phase
            return True

    def _mark_staged(self) -> None:
        with self._lock:
            if self.staged.done():
                return
            if self._phase is Phase.STAGING:
                self._phase = Phase.STAGED
        self.staged._complete(None)

    def _mark_committed(self, result: SaveResult) -> None:
        if not self._settle(Phase.SKIPPED if result.skipped else Phase.COMMITTED):
            return
        if not self.staged.done():
            self.staged._complete(None)
        self._safe.set()
        self._complete(result)

    def _mark_handed(self, node: str) -> None:
        """A peer's agent holds this rank's share and writes it: safe before it is committed."""
        self.handed_to = node
        self._safe.set()

    def _mark_failed(self, error: BaseException, *, reported: bool = False) -> None:
        """``reported``: the error is being raised to the caller already (not again later)."""
        if not self._settle(Phase.FAILED):
            return
        self._reported = reported
        if not self.staged.done():
            self.staged._fail(error)
        self._safe.set()
        self._fail(error)

    def _take_error(self) -> BaseException | None:
        """The background error, once: the first caller to take it raises it."""
        if not self.done():
            return None
        error = Future.exception(self)
        with self._lock:
            if error is None or self._reported:
                return None
            self._reported = True
        return error

    def _wait_done(self) -> None:
        """Block until committed or failed, without raising (errors go through _take_error)."""
        Future.exception(self)


def skipped(step: int, url: str) -> SaveHandle:
    """The handle of a save dropped by ``on_busy="skip"``: done, ``result().skipped``."""
    handle = SaveHandle(step, url)
    handle._mark_committed(SaveResult(step, url, 0, 0.0, 0.0, skipped=True))
    return handle


__all__ = ["Phase", "SaveHandle", "SaveResult", "skipped"]
