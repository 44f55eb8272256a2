"""System calls under a checkpoint root, with ckptd's rules and errors: never follow a link
inside the root, refuse what is not a regular file, read every byte asked for or say where the
file ended, remove a tree without following links, and name the path in every error.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import sys
from typing import Any

from ckptd.errors import StorageError


def open_at(
    name: str,
    flags: int,
    dir_fd: int | None,
    where: str,
    check_regular: bool = False,
    *,
    root: bool = False,
) -> int:
    """``os.open`` with ckptd's errors: a link inside the root, a non-regular file, any other
    OSError as :class:`StorageError` naming ``where``; FileNotFoundError stays itself (the
    storage contract's "absent")."""
    try:
        fd = os.open(name, flags | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except ValueError as e:  # a NUL byte in the name
        raise StorageError(f"{where!r}: not a valid file name ({e})") from e
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and not root and flags & os.O_NOFOLLOW:
            try:
                is_link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
            except OSError:
                is_link = False
            if is_link:
                raise StorageError(
                    f"{where}: a symbolic link inside the checkpoint root; ckptd never follows "
                    "links inside a root (docs/storage.md)"
                ) from e
            if e.errno == errno.ENOTDIR:
                raise NotADirectoryError(e.errno, f"{where}: not a directory") from e
        raise storage_error(e, where) from e
    if check_regular:
        _check_regular(fd, where)
    return fd


def _check_regular(fd: int, where: str) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StorageError(f"{where}: not a regular file (a FIFO, device or directory)")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


# Linux openat2(2) (5.6+; the same number on every architecture of the unified table)
_OPENAT2 = 437
_RESOLVE = 0x02 | 0x04 | 0x08  # RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH
_openat2_ok = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
_syscall: Any = None
_hows: dict[int, Any] = {}  # openat2's open_how by flags (read-only to the kernel: shared)


def open_beneath(dir_fd: int, path: str, flags: int, where: str) -> int | None:
    """``path`` (several components) under the directory ``dir_fd`` opened in one system
    call that follows no link in any component and never leaves the directory (``openat2``
    with ``RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH``): one open where a walk makes one per
    component. FileNotFoundError when a component is missing; None when it cannot say (no
    ``openat2`` here, or a link, a rename race, any other error: the caller walks, and its
    walk names the problem). A regular file only, like ``open_at(..., check_regular=True)``,
    unless ``flags`` has ``O_DIRECTORY`` (then a directory only: the system checks)."""
    global _openat2_ok, _syscall
    if not _openat2_ok:
        return None
    if _syscall is None:
        _syscall = ctypes.CDLL(None, use_errno=True).syscall
        _syscall.restype = ctypes.c_long
    how = _hows.get(flags)
    if how is None:
        how = _hows[flags] = ctypes.pointer(_OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE))
    fd = int(_syscall(ctypes.c_long(_OPENAT2), ctypes.c_int(dir_fd),
                     ctypes.c_char_p(os.fsencode(path)), how,
                     ctypes.c_size_t(ctypes.sizeof(_OpenHow))))
    if fd >= 0:
        if not flags & os.O_DIRECTORY:
            _check_regular(fd, where)
        return fd
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        raise FileNotFoundError(errno.ENOENT, "no such file", where)
    if err in (errno.ENOSYS, errno.EPERM, errno.E2BIG):  # an old kernel, a seccomp filter
        _openat2_ok = False
    return None


def pread_all(fd: int, buf: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(buf):  # preadv may return short on some filesystems
        try:
            n = os.preadv(fd, [buf[done:]], offset + done)
        except OverflowError as e:
            raise EOFError(f"{where}: offset {offset} out of range") from e
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise EOFError(f"{where}: offset {offset} is invalid") from e
            raise storage_error(e, where) from e
        if n == 0:
            raise EOFError(
                f"{where}: wanted {len(buf)} bytes at offset {offset}, file ends after {done}"
            )
        done += n


def rmtree_at(dir_fd: int, name: str) -> None:
    """Remove directory ``name`` under ``dir_fd`` and everything below it without following a
    link (links are unlinked themselves)."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                 dir_fd=dir_fd)
    try:
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                rmtree_at(fd, entry.name)
            else:
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def storage_error(e: OSError, path: str) -> StorageError:
    reason = "disk full (ENOSPC)" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    err = StorageError(f"{path}: {reason}")
    err.errno = e.errno
    return err
