"""Local (or shared) filesystem backend: the fast path, no fsspec involved."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator, Sequence

from ckptd.buffers import Buffer
from ckptd.errors import StorageError
from ckptd.storage import local_dirs
from ckptd.storage.base import Gate, Probe, Storage, blocks
from ckptd.storage.local_read import LocalReadSession
from ckptd.storage.posix import open_at, pread_all, rmtree_at, storage_error
from ckptd.storage.watch import Watch, watching

log = logging.getLogger("ckptd")

# Directories a LocalStorage keeps open for reads: a load opens the files of one step (its data
# directory, a few more), a catalog scan the step directories; more are closed oldest first
READ_DIRS = 64

_DIRECT_OK = hasattr(os, "O_DIRECT")
_DIRECT_ALIGN = 4096
_DIRECT_MIN = 4 << 20  # smaller files are not worth bypassing the cache


def _direct_eligible(parts: list[memoryview]) -> bool:
    """O_DIRECT needs every write's length (and the buffer's address, checked by the kernel)
    aligned; only the staged arena's file images are, and only large ones are worth it."""
    total = sum(len(p) for p in parts)
    return total >= _DIRECT_MIN and all(len(p) % _DIRECT_ALIGN == 0 for p in parts)


def _sync_filesystem(root: str) -> None:
    """Flush the filesystem holding ``root`` to stable storage (Linux ``syncfs``; elsewhere
    ``sync``). A write error the kernel kept for later is raised here, naming the root."""
    try:
        syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        os.sync()
        return
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise StorageError(f"{root}: flushing the writes failed: {os.strerror(err)}")
    finally:
        os.close(fd)


class LocalStorage(Storage):
    """A directory on a POSIX filesystem (local disk, NFS, Lustre...).

    **Links inside the root are never followed.** Every path is opened one component at a
    time from the root's directory descriptor with ``O_NOFOLLOW`` (``openat``), so a symlink
    planted anywhere below the root (a ``step-...`` directory, ``metrics.jsonl``, a data file)
    is refused with an error naming it, and ``remove`` unlinks a link itself, never what it
    points to. On a shared, group-writable filesystem that is what keeps one user's link from
    making another user's job write, read or delete outside its checkpoints. The root itself
    may be a link (``/ckpt -> /mnt/fast/ckpt``). Anything but a regular file (a FIFO, a device)
    is refused at open time, before a read could block or never end.
    """

    def __init__(self, root: str, *, direct: bool = True) -> None:
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.root = os.path.abspath(root)
        self.url = self.root
        self.direct = direct
        self._defer = False  # inside deferred_durability(): no fsync per write
        # inside deferred_durability(): the directories walked so far, kept open (a writer of
        # thousands of files in a few directories walks each once; a walk is one open per
        # path component, four or five per file, each a metadata operation)
        self._dirs: dict[tuple[str, ...], int] | None = None
        self._dirs_lock = threading.Lock()
        self._unsynced = threading.local()  # inside put_visible(): put_atomic without fsyncs
        # the directories reads have walked, kept open (local_dirs.ReadDirs), closed by close()
        # or when the storage is collected
        self._read_dirs = local_dirs.ReadDirs(self.root, READ_DIRS)
        weakref.finalize(self, self._read_dirs.clear)

    @contextlib.contextmanager
    def deferred_durability(self) -> Iterator[None]:
        """Writes skip their fsyncs, and the directories they write into are walked once; on
        leaving, one ``syncfs`` of the root's filesystem (``sync`` where there is none) makes
        them durable together."""
        self._defer = True
        self._dirs = {}
        try:
            yield
        finally:
            self._defer = False
            self._forget_dirs(stop=True)
        _sync_filesystem(self.root)

    def _forget_dirs(self, stop: bool = False) -> None:
        with self._dirs_lock:
            dirs, self._dirs = self._dirs, (None if stop or self._dirs is None else {})
        for fd in (dirs or {}).values():
            os.close(fd)

    def _fsync(self, fd: int) -> None:
        if not self._defer and not getattr(self._unsynced, "on", False):
            self._sync(fd)

    def _sync(self, fd: int) -> None:
        """The one place a file or directory is flushed to stable storage."""
        os.fsync(fd)

    # -- paths ---------------------------------------------------------------------------------
    def _abs(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def _parts(self, path: str) -> list[str]:
        parts = [p for p in path.split("/") if p]
        if "\0" in path or any(p in (".", "..") for p in parts) or path.startswith("/"):
            raise StorageError(f"{self._abs(path)!r}: not a path inside the checkpoint root")
        return parts

    def _dir_fd(self, parts: list[str], create: bool) -> int:
        """A descriptor of the directory ``root/parts`` (the caller closes it), walked without
        following links (and made, with ``create``). FileNotFoundError when a component is
        missing. Inside ``deferred_durability()``, a copy of the descriptor of the first walk."""
        if self._dirs is None:
            return self._walk(parts, create)
        key = tuple(parts)
        with self._dirs_lock:
            cached = None if self._dirs is None else self._dirs.get(key)
            if cached is not None:
                return os.dup(cached)
        fd = self._walk(parts, create)
        with self._dirs_lock:
            if self._dirs is not None and key not in self._dirs:
                self._dirs[key] = os.dup(fd)
        return fd

    def _walk(self, parts: list[str], create: bool) -> int:
        """A descriptor of ``root/parts``, walked without following links
        (:func:`ckptd.storage.local_dirs.walk`)."""
        return local_dirs.walk(self.root, parts, create)

    def close(self) -> None:
        """Close the directories kept open for reads (the storage stays usable: they are
        opened again when needed)."""
        self._read_dirs.clear()

    def _open_file(self, path: str, flags: int, create_dirs: bool = False) -> int:
        parts = self._parts(path)
        if not parts:
            raise StorageError(f"{self.root}: the root is not a file")
        flags |= os.O_NOFOLLOW | os.O_NONBLOCK
        if not create_dirs and not flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            try:
                return self._read_dirs.open_file(parts, flags, self._abs(path))
            except local_dirs.Removed:  # a kept directory was removed (and maybe made again)
                self._read_dirs.clear()
        try:
            dfd = self._dir_fd(parts[:-1], create_dirs)
            try:
                return open_at(parts[-1], flags, dfd, self._abs(path), check_regular=True)
            finally:
                os.close(dfd)
        except FileNotFoundError as e:  # name the whole path, not the last component
            raise FileNotFoundError(errno.ENOENT, "no such file", self._abs(path)) from e

    # -- writes --------------------------------------------------------------------------------
    def write_file(self, path: str, parts: Iterable[Buffer], gate: Gate | None = None) -> int:
        full = self._abs(path)
        try:
            if _DIRECT_OK and self.direct and isinstance(parts, (list, tuple)):
                views = [memoryview(p).cast("B") for p in parts]
                if _direct_eligible(views):
                    written = self._write_direct(path, views, gate)
                    if written is not None:
                        return written
            return self._write_buffered(path, parts, gate)
        except StorageError:
            raise
        except OSError as e:
            raise storage_error(e, full) from e

    def _write_buffered(self, path: str, parts: Iterable[Buffer], gate: Gate | None) -> int:
        total = 0
        fd = self._open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, create_dirs=True)
        try:
            for block in blocks(parts, gate=gate):
                total += self._write_all(fd, block)
            self._fsync(fd)
        finally:
            os.close(fd)
        return total

    def _write_direct(self, path: str, parts: list[memoryview],
                      gate: Gate | None) -> int | None:
        """Write bypassing the page cache: faster on a loaded host (``benchmarks/save.py``
        floors) and it leaves the training's memory bandwidth and cache alone. None if the
        filesystem or buffer refuses (EINVAL): the caller falls back to buffered I/O."""
        try:
            fd = self._open_file(
                path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, create_dirs=True
            )
        except StorageError as e:
            if getattr(e, "errno", None) == errno.EINVAL:
                return None
            raise
        total = 0
        try:
            for block in blocks(parts, gate=gate):
                total += self._write_all(fd, block)
            self._fsync(fd)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return None
        finally:
            os.close(fd)
        return total

    def _write_all(self, fd: int, view: memoryview) -> int:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        return done

    def put_atomic(self, path: str, data: bytes) -> None:
        parts = self._parts(path)
        full = self._abs(path)
        dfd = self._dir_fd(parts[:-1], create=True)
        tmp = f"{parts[-1]}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            fd = open_at(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, dfd, full)
            try:
                self._write_all(fd, memoryview(data))
                self._fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces a link itself
            self._fsync(dfd)
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise e if isinstance(e, StorageError) else storage_error(e, full) from e
        finally:
            os.close(dfd)

    def put_visible(self, path: str, data: bytes) -> None:
        """:meth:`put_atomic` (temp file + rename: a reader sees all or nothing) without its
        two fsyncs; through ``put_atomic``, so a subclass that changes it changes this too."""
        self._unsynced.on = True
        try:
            self.put_atomic(path, data)
        finally:
            self._unsynced.on = False

    @contextlib.contextmanager
    def probe(self, paths: Sequence[str]) -> Iterator[Probe]:
        """Each path's directory opened once (without following links), then one ``stat`` of
        its name a call: a waiter's poll makes no walk. A directory missing at the start is
        asked about by path each time (it may appear)."""
        where: list[tuple[int | None, str, str]] = []
        opened: dict[tuple[str, ...], int | None] = {}
        try:
            for path in paths:
                parts = self._parts(path)
                key = tuple(parts[:-1])
                if key not in opened:
                    try:
                        opened[key] = self._walk(parts[:-1], False)
                    except (FileNotFoundError, NotADirectoryError):
                        opened[key] = None
                where.append((opened[key], parts[-1], path))

            def seen() -> list[bool]:
                out = []
                for dfd, name, path in where:
                    if dfd is None:
                        out.append(self.exists(path))
                        continue
                    try:
                        os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        out.append(True)
                    except FileNotFoundError:
                        out.append(False)
                return out

            yield seen
        finally:
            for fd in opened.values():
                if fd is not None:
                    os.close(fd)

    @contextlib.contextmanager
    def watch(self, dirs: Sequence[str], names: Sequence[str] | None = None,
              ) -> Iterator[Watch | None]:
        """inotify on each directory of ``dirs`` that exists now, opened without following
        links, woken by any name or by ``names`` (:mod:`ckptd.storage.watch`)."""
        fds: list[int] = []
        try:
            for d in dirs:
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    fds.append(self._walk(self._parts(d), False))
            with watching(fds, names) as w:
                yield w
        finally:
            for fd in fds:
                os.close(fd)

    def append_text(self, path: str, text: str) -> None:
        """Append to a log-like file (metrics); not part of the storage contract."""
        fd = self._open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, create_dirs=True)
        try:
            self._write_all(fd, memoryview(text.encode()))
        except OSError as e:
            raise storage_error(e, self._abs(path)) from e
        finally:
            os.close(fd)

    # -- reads ---------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        fd = self._open_file(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            out = bytearray(size)
            pread_all(fd, memoryview(out), 0, self._abs(path))
            return bytes(out)
        finally:
            os.close(fd)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytearray]:
        fd = self._open_file(path, os.O_RDONLY)
        try:
            out = []
            for offset, length in ranges:
                data = bytearray(length)
                pread_all(fd, memoryview(data), offset, self._abs(path))
                out.append(data)
            return out
        finally:
            os.close(fd)

    def open_read(self, paths: Sequence[str]) -> LocalReadSession:
        """Open ``paths`` once for a load: sizes known up front, reads with ``preadv`` into the
        caller's buffers, and the files stay readable until ``close`` even if retention
        removes them meanwhile (an unlinked file lives on while it is open)."""
        return LocalReadSession(lambda p: self._open_file(p, os.O_RDONLY), self._abs, paths)

    def size(self, path: str) -> int:
        fd = self._open_file(path, os.O_RDONLY)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        parts = self._parts(path)
        if not parts:
            return os.path.isdir(self.root)
        try:
            dfd = self._dir_fd(parts[:-1], create=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            raise storage_error(e, self._abs(path)) from e
        finally:
            os.close(dfd)

    def list_dir(self, path: str) -> list[str]:
        """Names of the children, links left out (with a warning): ckptd never uses a link
        inside the root, so to the catalog, retention and gc a planted link does not exist."""
        try:
            fd = self._dir_fd(self._parts(path), create=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        try:
            names = []
            for entry in os.scandir(fd):
                if entry.is_symlink():
                    log.warning("ckptd: ignoring %s: a symbolic link inside the checkpoint root",
                                os.path.join(self._abs(path), entry.name))
                    continue
                names.append(entry.name)
            return sorted(names)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        parts = self._parts(path)
        if not parts:
            raise StorageError(f"{self.root}: refusing to remove the checkpoint root")
        self._forget_dirs()  # a kept directory may be the one removed
        self._read_dirs.clear()
        try:
            dfd = self._dir_fd(parts[:-1], create=False)
        except (FileNotFoundError, NotADirectoryError):
            return
        name = parts[-1]
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                # fd-based and link-safe: never descends through a link
                rmtree_at(dfd, name)
            else:  # a file, or a link (removed itself, never its target)
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(e, self._abs(path)) from e
        finally:
            os.close(dfd)
