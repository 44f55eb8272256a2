"""The directory side of :class:`~ckptd.storage.local.LocalStorage`: walking to a directory
below the root without following links, and the directories reads keep open.

Every path below the root is opened one component at a time from the root's descriptor with
``O_NOFOLLOW``, or in one ``openat2`` that follows no link and stays below the root, so a link
planted anywhere below the root is refused, naming it (``LocalStorage``'s docstring says why).
"""

from __future__ import annotations

import errno
import os
import threading

from ckptd.storage.posix import open_at, open_beneath, storage_error

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def walk(root: str, parts: list[str], create: bool) -> int:
    """A descriptor of the directory ``root/parts`` (the caller closes it), walked without
    following links (and made, with ``create``). FileNotFoundError when a component is
    missing.

    Every write walks. The common case (the root and the directories exist): the root, then the
    rest in one openat2 that follows no link and stays below the root. As safe as the walk
    below — each call resolves the whole path again, so a directory replaced by a link since the
    last call is refused — in three system calls instead of two per component. Anything else (a
    directory to make, a link, no openat2 here) takes the walk, which makes the directories and
    names the problem."""
    if parts:
        fd = _walk_beneath(root, parts)
        if fd is not None:
            return fd
    try:
        fd = open_at(root, os.O_RDONLY | os.O_DIRECTORY, None, root, root=True)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as e:
            raise storage_error(e, root) from e
        fd = open_at(root, os.O_RDONLY | os.O_DIRECTORY, None, root, root=True)
    where = root
    try:
        for name in parts:
            where = os.path.join(where, name)
            try:
                nxt = open_at(name, _DIR_FLAGS, fd, where, False)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise storage_error(e, where) from e
                nxt = open_at(name, _DIR_FLAGS, fd, where, False)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _walk_beneath(root: str, parts: list[str]) -> int | None:
    """``root/parts`` opened in one ``openat2`` below a fresh descriptor of the root; None when
    it cannot (missing, a link, no ``openat2``): the caller walks."""
    try:
        rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return open_beneath(rfd, "/".join(parts), _DIR_FLAGS, root)
    except FileNotFoundError:
        return None
    finally:
        os.close(rfd)


class Removed(Exception):
    """A directory kept open for reads was removed since."""


class ReadDirs:
    """The directories reads have walked below ``root``, kept open: each is opened once
    (``O_NOFOLLOW``, from its parent's descriptor), not once per file (a load opens hundreds of
    files in a few directories; on a shared filesystem every open is a metadata operation). At
    most ``limit`` (the oldest closed first); thread-safe. Callers get a duplicate (``os.dup``:
    no filesystem operation) and close it themselves, so one closed here meanwhile does not
    pull the directory from under them."""

    def __init__(self, root: str, limit: int) -> None:
        self.root, self.limit = root, limit
        self._fds: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()

    def open_file(self, parts: list[str], flags: int, where: str) -> int:
        """Open the file ``root/parts`` for reading: in one ``openat2`` from the root's kept
        descriptor where the system has it (no link followed, nothing outside the root), else
        from its directory's kept descriptor. :class:`Removed` when a kept directory was
        removed; FileNotFoundError naming ``where`` when the file is missing."""
        dfd = -1
        try:
            dfd = self._dir_fd([])
            fd = open_beneath(dfd, "/".join(parts), flags, where)
            if fd is not None:
                return fd
            if len(parts) > 1:
                os.close(dfd)
                dfd = -1
                dfd = self._dir_fd(parts[:-1])
            return open_at(parts[-1], flags, dfd, where, check_regular=True)
        except FileNotFoundError as e:
            if dfd < 0 or os.fstat(dfd).st_nlink == 0:  # a directory missing, or removed
                raise Removed from None  # since it was kept: the walk says which
            raise FileNotFoundError(errno.ENOENT, "no such file", where) from e
        finally:
            if dfd >= 0:
                os.close(dfd)

    def _dir_fd(self, parts: list[str]) -> int:
        """A descriptor of the directory ``root/parts`` (the caller closes it)."""
        key = tuple(parts)
        fd = self._dup(key)
        if fd is not None:
            return fd
        if not parts:
            fd = open_at(self.root, os.O_RDONLY | os.O_DIRECTORY, None, self.root, root=True)
        else:
            parent = self._dir_fd(parts[:-1])
            try:
                fd = open_at(parts[-1], _DIR_FLAGS, parent, os.path.join(self.root, *parts),
                             False)
            finally:
                os.close(parent)
        self._keep(key, fd)
        return fd

    def _dup(self, key: tuple[str, ...]) -> int | None:
        with self._lock:
            fd = self._fds.get(key)
            return None if fd is None else os.dup(fd)

    def _keep(self, key: tuple[str, ...], fd: int) -> None:
        """Keep a duplicate of ``fd`` (the caller keeps ``fd``)."""
        with self._lock:
            if key in self._fds:
                return
            self._fds[key] = os.dup(fd)
            while len(self._fds) > self.limit:
                os.close(self._fds.pop(next(iter(self._fds))))

    def clear(self) -> None:
        """Close every kept directory (they are opened again when needed)."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


__all__ = ["ReadDirs", "Removed", "walk"]
