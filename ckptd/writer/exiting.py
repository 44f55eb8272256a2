"""When the process is on its way out, the waits of its in-flight saves on other ranks (or on the
node agent) end at a deadline instead of ``commit_timeout_s``.

Two callers set it with :func:`begin`: a trainer's exit drain after an unhandled error
(:mod:`ckptd.lifecycle`, ``error_exit_wait_s`` of ``ckptd.config``), and a stopping node
agent when its SIGTERM grace window ends (:mod:`ckptd.agent.server`). The commit's polls
(:class:`ckptd.writer.commit.Poller`: :func:`deadline`, :func:`pause`) and the wait for the node
agent's reply (:func:`result`) wake at once when it is called, and end at their deadline with
:class:`Abandoned`: the save is left to whoever can still finish it. In a process that never
begins exiting this way, nothing waits any differently.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from ckptd.errors import CkptdError
from ckptd.storage import watch

T = TypeVar("T")


@dataclass(frozen=True)
class _Exit:
    started: float  # monotonic
    wait_s: float  # a coordinator's wait for the other ranks' partials
    follow_s: float  # any other wait: for the commit, for the node agent's reply
    why: str


_cond = threading.Condition()
_exit: _Exit | None = None  # set once, by begin()


class Abandoned(CkptdError):
    """This process stopped waiting for a save's other half: it is exiting on an error."""


def begin(wait_s: float, why: str, *, follow_s: float | None = None) -> None:
    """The process is on its way out (``why``, for the errors). A coordinator's wait for the
    other ranks' partials ends ``wait_s`` seconds after this call or its own start, whichever
    is later; any other wait (for the commit, for the node agent's reply: this process adds
    nothing to the outcome by waiting) ``follow_s`` after it (default: ``wait_s``). Only the
    first call counts."""
    global _exit
    with _cond:
        if _exit is None:
            wait_s = max(0.0, wait_s)
            _exit = _Exit(time.monotonic(), wait_s,
                          wait_s if follow_s is None else max(0.0, follow_s), why)
        _cond.notify_all()
    watch.wake_all()  # a wait paused on a filesystem watch checks its new deadline now


def active() -> bool:
    """Whether the process began exiting this way (:func:`begin`)."""
    with _cond:
        return _exit is not None


def deadline(since: float, *, coordinating: bool) -> float | None:
    """When a wait that started at ``since`` (monotonic) must end; None while not exiting."""
    with _cond:
        return _deadline(since, coordinating)


def reason() -> str:
    """Why a wait was abandoned, for its error message."""
    with _cond:
        return _reason()


def pause(seconds: float) -> None:
    """Sleep ``seconds``, or less when :func:`begin` is called meanwhile."""
    with _cond:
        _cond.wait(seconds)


def result(future: Future[T], since: float, what: str) -> T:
    """``future.result()``, except that once the process is exiting on an error, a wait begun
    at ``since`` raises :class:`Abandoned` (naming ``what``) when it reaches its deadline."""
    future.add_done_callback(_wake)
    with _cond:
        while not future.done():
            end = _deadline(since, False)
            if end is None:
                _cond.wait()
            elif end <= time.monotonic():
                raise Abandoned(f"{what}: {_reason()}")
            else:
                _cond.wait(end - time.monotonic())
    return future.result()


def _deadline(since: float, coordinating: bool) -> float | None:
    if _exit is None:
        return None
    return max(since, _exit.started) + (_exit.wait_s if coordinating else _exit.follow_s)


def _reason() -> str:
    return _exit.why if _exit is not None else "this process is exiting"


def _wake(_: object) -> None:
    with _cond:
        _cond.notify_all()


__all__ = ["Abandoned", "begin", "deadline", "pause", "reason", "result"]
