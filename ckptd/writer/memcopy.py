"""Parallel host-memory copies for staging (the copy the caller of ``save_async`` waits for).

A second thread raises the copy bandwidth over one thread's when a core is free
(``benchmarks/save.py`` floors); during the stall the caller's thread is blocked anyway, so
staging uses up to ``config.stage_threads`` threads. Copies are cut into segments of
``SEGMENT`` bytes that the caller and the helper threads take from one shared list. The caller
waits only for segments in flight, never for a helper to be scheduled: on a busy host where no
helper gets a core, the caller copies everything itself (torch's ``copy_`` instead splits every
call over its intra-op threads and waits for all of them, which made staging 3-15x slower on a
loaded host).
``ctypes.memmove`` releases the GIL, so the threads copy in parallel.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ckptd import config

SEGMENT = 8 << 20  # ~0.3-0.6 ms of copying: coarse enough for the lock, fine enough to balance

Copy = tuple[int, int, int]  # (destination address, source address, bytes)

_pool: tuple[int, ThreadPoolExecutor] | None = None  # (size, pool)
_pool_lock = threading.Lock()


def _helpers(n: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != n:  # a new size comes only from a config change
            _pool = (n, ThreadPoolExecutor(n, thread_name_prefix="ckptd-stage"))
        return _pool[1]


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


class _Segments:
    def __init__(self, copies: list[Copy]) -> None:
        self.todo = [
            (dst + o, src + o, min(SEGMENT, n - o))
            for dst, src, n in copies
            for o in range(0, n, SEGMENT)
        ]
        self.next = 0
        self.busy = 0
        self.cond = threading.Condition()

    def work(self) -> None:
        while True:
            with self.cond:
                if self.next == len(self.todo):
                    return
                dst, src, n = self.todo[self.next]
                self.next += 1
                self.busy += 1
            try:
                ctypes.memmove(dst, src, n)
            finally:
                with self.cond:
                    self.busy -= 1
                    self.cond.notify_all()

    def wait(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.busy == 0 and self.next == len(self.todo))

    def cancel(self) -> None:
        """Hand out no more segments and wait for those in flight: after an interrupt (Ctrl-C
        lands in the caller's thread) no helper may still be writing into the arena once the
        caller releases it for reuse."""
        with self.cond:
            self.next = len(self.todo)
            self.cond.wait_for(lambda: self.busy == 0)


def copy_all(copies: list[Copy], threads: int | None = None) -> None:
    """``memmove`` every ``(dst, src, n)``; returns when all are done. Uses up to ``threads``
    threads, the caller's included (default ``config.stage_threads()``)."""
    total = sum(n for _, _, n in copies)
    k = 1 if total <= SEGMENT else config.stage_threads() if threads is None else threads
    if k <= 1:  # one segment's worth (no helper pays for its hand-off), or one thread
        for dst, src, n in copies:
            ctypes.memmove(dst, src, n)
        return
    segments = _Segments(copies)
    helpers = min(k, -(-total // SEGMENT)) - 1  # no more threads than segments' worth
    if helpers > 0:
        pool = _helpers(k - 1)
        try:
            for _ in range(helpers):
                pool.submit(segments.work)
        except RuntimeError:  # interpreter shutdown: no new threads; the caller copies alone
            pass
    try:
        segments.work()
        segments.wait()
    except BaseException:
        segments.cancel()
        raise
