"""Faults come from subclasses of the real local backend, not from patching internals."""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Iterable

from ckptd.storage.local import LocalStorage


class FailAfterBytes(LocalStorage):
    """Data files fail with ``error`` once ``limit`` bytes were written in total (a full disk,
    a dying NFS server...). Partials and manifests still go through."""

    def __init__(self, root: str, limit: int, error: int = errno.EIO) -> None:
        super().__init__(root)
        self.limit = limit
        self.error = error
        self.written = 0
        self._count_lock = threading.Lock()

    def write_file(self, path: str, parts: Iterable[bytes | bytearray | memoryview],
                   gate=None) -> int:  # type: ignore[no-untyped-def]
        def counted() -> Iterable[memoryview]:
            for part in parts:
                view = memoryview(part).cast("B")
                with self._count_lock:
                    room = self.limit - self.written
                    self.written += len(view)
                if room < len(view):
                    yield view[: max(0, room)]
                    raise OSError(self.error, os.strerror(self.error), path)
                yield view

        return super().write_file(path, counted(), gate)


class KillAtOp(LocalStorage):
    """SIGKILLs its own process at the ``n``-th storage mutation (write_file / put_atomic /
    remove), mid-way through that operation's bytes when it writes data."""

    def __init__(self, root: str, n: int) -> None:
        super().__init__(root)
        self.n = n
        self.ops = 0

    def _tick(self) -> bool:
        self.ops += 1
        return self.ops == self.n

    def write_file(self, path: str, parts: Iterable[bytes | bytearray | memoryview],
                   gate=None) -> int:  # type: ignore[no-untyped-def]
        if not self._tick():
            return super().write_file(path, parts, gate)

        def half() -> Iterable[memoryview]:
            for part in parts:
                view = memoryview(part).cast("B")
                yield view[: len(view) // 2]
                os.kill(os.getpid(), signal.SIGKILL)

        return super().write_file(path, half(), gate)

    def put_atomic(self, path: str, data: bytes) -> None:
        if self._tick():
            os.kill(os.getpid(), signal.SIGKILL)
        super().put_atomic(path, data)

    def remove(self, path: str) -> None:
        if self._tick():
            os.kill(os.getpid(), signal.SIGKILL)
        super().remove(path)
