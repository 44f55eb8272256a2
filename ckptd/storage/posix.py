"""System calls under a checkpoint root, with ckptd's rules and errors: never follow a link
inside the root, refuse what is not a regular file, read every byte asked for or say where the
file ended, remove a tree without following links, and name the path in every error.
"""

from __future__ import annotations

import errno
import os
import stat

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
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise StorageError(f"{where}: not a regular file (a FIFO, device or directory)")
    return fd


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
