"""A load's files on a local filesystem, opened once (:meth:`LocalStorage.open_read`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from ckptd.storage.posix import pread_all


class LocalReadSession:
    """Files of one load, opened once (see :meth:`LocalStorage.open_read`)."""

    fills_buffers = True  # reads go straight into the caller's memory
    resident = False

    def __init__(self, open_file: Callable[[str], int], where: Callable[[str], str],
                 paths: Sequence[str]) -> None:
        """``open_file(path)``: a descriptor of the file for reading; ``where(path)``: its
        path as errors name it."""
        self._open, self._where = open_file, where
        self._fds: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        try:
            for p in dict.fromkeys(paths):
                fd = open_file(p)
                self._fds[p] = fd
                self.sizes[p] = os.fstat(fd).st_size
        except BaseException:
            self.close()
            raise

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        fd = self._fds.get(path)
        if fd is None:  # not opened up front: open it now
            fd = self._open(path)
            self._fds[path] = fd
        pread_all(fd, buf, offset, self._where(path))

    def read(self, path: str, offset: int, length: int) -> bytearray:
        out = bytearray(length)
        self.read_into(path, offset, memoryview(out))
        return out

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> LocalReadSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LocalReadSession"]
